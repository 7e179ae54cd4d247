"""API keys (gateway/access.py): which Authorization values name a tenant, where keys come from, what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.access import ENV_VAR, ApiKeyError, ApiKeys, api_keys, keys_from_file
from gateway.cache_scope import page_salt
from gateway.config import parse_config
from gateway.request import Submission, TextPrompt
from proto import messages


def test_a_key_presented_as_bearer_names_its_tenant_and_nothing_else_does() -> None:
    keys = ApiKeys.of(["alpha-key", "beta-key"])
    alpha, beta = keys.tenant("Bearer alpha-key"), keys.tenant("bearer  beta-key ")
    assert alpha is not None and beta is not None and alpha != beta
    assert keys.tenant("BEARER alpha-key") == alpha  # the scheme is case-insensitive, the key is not
    for wrong in (
        None,
        "",
        "Bearer",
        "Bearer ",
        "alpha-key",
        "Basic alpha-key",
        "Bearer ALPHA-KEY",
        "Bearer alpha-ke",
        "Bearer alpha-keyy",
        "Bearer \udcff",
    ):
        assert keys.tenant(wrong) is None, wrong
    assert "alpha" not in alpha and len(alpha) == 16  # the tenant id tells nothing of the key


def test_the_same_key_is_the_same_tenant_in_every_gateway() -> None:
    # Tenants outlive a gateway's restart and are shared by gateways with the same keys: the prefix cache is keyed
    # by them in the scheduler, which outlives both.
    assert ApiKeys.of(["k1", "k2"]).tenant("Bearer k2") == ApiKeys.of(["k2"]).tenant("Bearer k2")


def test_without_keys_the_ports_are_open_and_the_caller_is_nobody() -> None:
    assert not ApiKeys().required and ApiKeys().tenant("Bearer anything") is None


@pytest.mark.parametrize("key", ["", "has space", "tab\tkey", "naïve", "line\nbreak"])
def test_a_key_that_cannot_travel_in_a_header_is_refused(key: str) -> None:
    with pytest.raises(ApiKeyError):
        ApiKeys.of([key])


def test_keys_come_from_flags_a_file_and_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# comment\n\n  file-key  \nsecond-key\n")
    assert keys_from_file(key_file) == ["file-key", "second-key"]
    keys = api_keys(["flag-key"], key_file, environ={ENV_VAR: "env-key"})
    assert all(keys.tenant(f"Bearer {key}") for key in ("flag-key", "file-key", "second-key", "env-key"))
    assert not api_keys([], None, environ={ENV_VAR: ""}).required
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ApiKeyError, match="holds no key"):
        keys_from_file(tmp_path / "empty")
    with pytest.raises(ApiKeyError, match="cannot be read"):
        keys_from_file(tmp_path / "missing")


def test_the_tenant_scope_takes_the_keys_given(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    base = ["--model", str(default_model_dir), "--insecure-loopback"]
    key_file = tmp_path / "keys"
    key_file.write_text("k\n")
    config = parse_config([*base, "--prefix-cache-scope", "tenant", "--api-key-file", str(key_file)])
    assert config.api_keys.required and config.prefix_cache_scope == "tenant"
    with pytest.raises(SystemExit):
        parse_config([*base, "--api-key", "two words"])


def _submission(tenant: str | None, salt: str | None) -> Submission:
    return Submission(
        request_id="r",
        prompt=TextPrompt("x"),
        prompt_field="prompt",
        max_tokens=1,
        sampling=messages.SamplingParams(),
        seed_given=False,
        stop_strings=(),
        stop_token_ids=(),
        ignore_eos=False,
        cache_salt=salt,
        tenant=tenant,
        own_salt="own",
    )


def test_tenants_salts_never_meet_each_other_or_a_clients() -> None:
    salts = {page_salt("tenant", _submission(tenant, salt)) for tenant in ("t1", "t2") for salt in (None, "s", "t1")}
    salts |= {
        page_salt(scope, _submission(None, salt)) for scope in ("global", "salt") for salt in (None, "s", "tenant:t1")
    }
    assert len(salts) == 6 + 4  # global and salt agree on a client's salt, and nothing else meets
    with pytest.raises(ValueError):
        page_salt("tenant", _submission(None, None))
