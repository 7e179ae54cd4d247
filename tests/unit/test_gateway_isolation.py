"""Which requests share prefix-cache pages
(the salt each request's pages are keyed under, per --prefix-cache-scope), and
the ids clients give their requests."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gateway.cache_scope import UNSALTED, page_salt
from gateway.choices import sibling
from gateway.config import parse_config
from gateway.errors import InvalidArgument
from gateway.openai_request import OPENAI_FIELDS
from gateway.request import ClientRequest, Submission, TextPrompt
from gateway.validation import validate


def submission(cache_salt: str | None = None) -> Submission:
    return validate(
        ClientRequest(TextPrompt("hi"), cache_salt=cache_salt), fields=OPENAI_FIELDS, request_id="r", vocab_size=100
    )


def test_global_scope_shares_unsalted_requests_and_separates_salted_ones() -> None:
    assert page_salt("global", submission()) == page_salt("global", submission()) == UNSALTED
    assert page_salt("global", submission("a")) == page_salt("global", submission("a")) != UNSALTED
    assert page_salt("global", submission("a")) != page_salt("global", submission("b"))


def test_salt_scope_shares_an_unsalted_request_only_with_its_own_copies() -> None:
    first, second = submission(), submission()
    assert page_salt("salt", first) != page_salt("salt", second)
    assert UNSALTED not in (page_salt("salt", first), page_salt("salt", second))
    copy = sibling(first, 1, "r-1", scores_prompt=False)
    assert page_salt("salt", copy) == page_salt("salt", first)
    assert page_salt("salt", submission("a")) == page_salt("global", submission("a"))


def test_a_clients_salt_never_names_a_requests_own() -> None:
    """A client that sends another request's own salt as its cache_salt still gets a salt of its own."""
    victim = submission()
    forged = submission(cache_salt=page_salt("salt", victim))
    assert page_salt("salt", forged) != page_salt("salt", victim)
    forged = submission(cache_salt=victim.own_salt)
    assert page_salt("salt", forged) != page_salt("salt", victim)


@pytest.mark.parametrize("salt", ["", "x" * 257, "tab\there"])
def test_a_bad_cache_salt_is_refused_naming_the_field(salt: str) -> None:
    with pytest.raises(InvalidArgument) as refused:
        submission(salt)
    assert refused.value.field == "cache_salt"


def test_tenant_scope_is_refused_at_start_without_api_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    (tmp_path / "tokenizer.json").write_text("{}")
    args = ["--model", str(tmp_path), "--insecure-loopback"]
    assert parse_config(args).prefix_cache_scope == "global"
    assert parse_config([*args, "--prefix-cache-scope", "salt"]).prefix_cache_scope == "salt"
    with pytest.raises(SystemExit):
        parse_config([*args, "--prefix-cache-scope", "tenant"])
    assert "tenants are told apart by their API keys, and none is given" in capsys.readouterr().err


def test_sglang_rids_name_each_prompts_replies() -> None:
    """SGLang's rid: a string (numbered per prompt in a batch) or a list of one per prompt; what is not is refused."""
    from gateway.api_error import ApiError
    from gateway.sglang_request import request_ids

    assert request_ids("mine", 1, True) == ["mine"]
    assert request_ids("mine", 2, False) == ["mine-0", "mine-1"]
    assert request_ids(["a", "b"], 2, False) == ["a", "b"]
    assert request_ids(None, 1, True)[0].startswith("sgl-")
    for rid, num, single, field in (
        (["a"], 2, False, "rid"),
        ([1, 2], 2, False, "rid"),
        (7, 1, True, "rid"),
        (["a", "b"], 1, True, "rid"),
        (["ok", "tab\t"], 2, False, "rid[1]"),
    ):
        with pytest.raises((ApiError, InvalidArgument)) as refused:
            request_ids(rid, num, single)
        error = refused.value
        assert (error.param if isinstance(error, ApiError) else error.field) == field


def test_the_tenant_a_draft_learns_for_is_the_api_keys_else_the_users_digest_else_shared() -> None:
    """What the scheduler and the draft service get as a request's tenant (SubmitRequest.tenant)."""

    def tenant_of(user: str | None, key_tenant: str | None = None) -> str:
        checked = validate(
            ClientRequest(TextPrompt("hi"), user=user), fields=OPENAI_FIELDS, request_id="r", vocab_size=100
        )
        checked = dataclasses.replace(checked, tenant=key_tenant)
        return checked.to_submit_request([1, 2], [0]).tenant

    assert tenant_of(None) == "" and tenant_of("") == ""
    alice, bob = tenant_of("alice"), tenant_of("bob")
    assert alice.startswith("user:") and alice != bob and "alice" not in alice and alice == tenant_of("alice")
    assert tenant_of("alice", key_tenant="0123") == tenant_of("bob", key_tenant="0123") == "key:0123"
    assert len(tenant_of("x" * 10_000)) <= 64  # a digest, whatever the client sent
