"""Which draft `specserve up` runs, and with which arguments, for the drafts a user can name."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import pytest

from common.defaults import HEAD_DRAFT_TOKENS
from common.draft_spec import DraftKind, DraftSpec
from modeling.model.store import default_draft_dir
from scheduler.config import SchedulerConfig, speculation_caps
from specserve.cli import _build_parser
from specserve.draft_choice import DraftChoice, default_draft, parse_draft
from specserve.stack import StackAddresses, service_specs
from specserve.up import stack_config


def test_the_shipped_draft_is_the_default_only_for_the_model_it_was_trained_for(
    default_model_dir: Path, tiny_llama_folder: Path
) -> None:
    assert default_draft(default_model_dir).name == "default"
    assert default_draft(tiny_llama_folder) == DraftChoice("ngram", DraftSpec(DraftKind.NGRAM))
    assert str(parse_draft("default").proposer) == f"phrases:{default_draft_dir()}"


def test_an_install_without_the_drafts_folder_falls_back_to_prompt_lookup(
    default_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import modeling.model.store

    monkeypatch.setattr(modeling.model.store, "default_draft_dir", lambda: tmp_path / "not-installed")
    assert default_draft(default_model_dir).name == "ngram"


def _service_argvs(*up_flags: str, model: Path) -> dict[str, list[str]]:
    """Each process's command line for `up UP_FLAGS` on a CPU, `model` standing for what up_config would find."""
    args = _build_parser().parse_args(["up", "--keys", "/keys", *up_flags])
    draft = parse_draft(args.draft).proposer if args.draft else None
    config = stack_config(args, model=model, max_model_len=2048, draft=draft, device="cpu", dtype="bfloat16")
    return {spec.name: spec.argv for spec in service_specs(config, StackAddresses.pick(config))}


def test_up_hands_the_api_key_file_and_the_tenant_scope_to_the_gateway(tmp_path: Path) -> None:
    argv = _service_argvs("--api-key-file", "/run/secrets/keys", "--prefix-cache-scope", "tenant", model=tmp_path)
    gateway = argv["gateway"]
    assert gateway[gateway.index("--api-key-file") + 1] == "/run/secrets/keys"
    assert gateway[gateway.index("--prefix-cache-scope") + 1] == "tenant"
    assert not any("--api-key" in arg for name, args in argv.items() if name != "gateway" for arg in args)
    gateway = _service_argvs("--allowed-origins", "https://app.example", model=tmp_path)["gateway"]
    assert gateway[gateway.index("--allowed-origins") + 1] == "https://app.example"
    scheduler = _service_argvs("--scheduling-policy", "priority", model=tmp_path)["scheduler"]
    assert scheduler[scheduler.index("--scheduling-policy") + 1] == "priority"


def test_lookups_speculate_in_larger_steps_and_longer_drafts_than_drafts_that_run_a_model() -> None:
    """The scheduler's caps unless told, from the kind the draft service's hello names (however the stack started)."""
    config = SchedulerConfig(
        gateway_address="",
        worker_address="",
        model_name="m",
        max_model_len=64,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_queue_len=8,
        no_worker_timeout_s=1.0,
        heartbeat_timeout_s=1.0,
        step_timeout_s=1.0,
    )
    for proposer in ("ngram", "phrases:/d"):
        assert speculation_caps(config, DraftSpec.parse(proposer, flag="--draft").kind.value) == (6, 16)
    assert (
        speculation_caps(config, parse_draft("default").proposer.kind.value) == speculation_caps(config, "") == (6, 16)
    )
    for proposer in ("eagle+ngram:/d", "eagle+phrases:/d", "model:/d"):
        assert speculation_caps(config, DraftSpec.parse(proposer, flag="--draft").kind.value) == (6, 4)
    assert speculation_caps(config, "eagle") == (HEAD_DRAFT_TOKENS, 4)
    told = dataclasses.replace(config, num_speculative_tokens=2, spec_disable_batch_threshold=32)
    assert speculation_caps(told, "eagle") == (2, 32)  # flags given win


def test_draft_names_are_checked_and_heads_get_the_target(tmp_path: Path) -> None:
    for good in (
        "none",
        "ngram",
        "suffix",
        "default",
        "phrases:x",
        "eagle:x",
        "eagle+ngram:x",
        "eagle+phrases:x",
        "model:x",
    ):
        assert parse_draft(good).name == good
    assert parse_draft("none").proposer is None
    assert parse_draft("eagle:x").proposer == DraftSpec(DraftKind.EAGLE, Path("x").resolve())
    for bad in ("eagle", "eagle+ngram:", "phrases", "ngram:x", "suffix:x", "tree:x", "random:5", "replay:x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected none, ngram, suffix, default, phrases:PATH"):
            parse_draft(bad)
    for kind in ("eagle+ngram", "eagle+phrases", "phrases"):
        specs = _service_argvs("--draft", f"{kind}:{tmp_path}", model=tmp_path / "model")
        scheduler = specs["scheduler"]
        assert scheduler[scheduler.index("--spec-draft-token-budget") + 1] == "32"
        command = specs["draft"]
        assert command[command.index("--proposer") + 1] == f"{kind}:{tmp_path.resolve()}"
        assert command[command.index("--target-model") + 1] == str(tmp_path / "model")
        assert "--head-draft-tokens" not in command  # unless told: the draft service's own default


def test_the_heads_proposal_length_reaches_the_draft_service(tmp_path: Path) -> None:
    command = _service_argvs(
        "--draft", f"eagle+phrases:{tmp_path}", "--head-draft-tokens", "1", model=tmp_path / "model"
    )["draft"]
    assert command[command.index("--head-draft-tokens") + 1] == "1"
    # Unless k is given, the draft service's own longest proposal (8) is past any k the scheduler asks for by default;
    # given, it is passed on, so that a lookup's proposal may still reach k.
    assert "--max-draft-tokens" not in command
    command = _service_argvs(
        "--draft", f"eagle+phrases:{tmp_path}", "--num-speculative-tokens", "7", model=tmp_path / "model"
    )["draft"]
    assert command[command.index("--max-draft-tokens") + 1] == "7"


@pytest.mark.parametrize(
    "draft, head_draft_tokens", [("ngram", "1"), ("eagle:{dir}", "1"), ("eagle+phrases:{dir}", "0")]
)
def test_head_draft_tokens_is_refused_before_anything_starts_where_it_means_nothing(
    tiny_llama_folder: Path, tmp_path: Path, draft: str, head_draft_tokens: str
) -> None:
    from specserve.cli import _run_up

    args = _build_parser().parse_args(
        [
            "up",
            "--model",
            str(tiny_llama_folder),
            "--draft",
            draft.format(dir=tmp_path),
            "--head-draft-tokens",
            head_draft_tokens,
        ]
    )
    with pytest.raises(SystemExit, match="--head-draft-tokens must be at least 1, with --draft eagle\\+ngram:PATH"):
        _run_up(args)


def test_token_trees_are_on_unless_turned_off_and_only_phrases_take_the_switch(
    tiny_llama_folder: Path, tmp_path: Path
) -> None:
    from specserve.cli import _run_up

    def draft_command(*argv: str) -> list[str]:
        return _service_argvs(*argv, model=tmp_path / "model")["draft"]

    assert "--no-token-trees" not in draft_command("--draft", "default")
    assert "--no-token-trees" in draft_command("--draft", "default", "--no-token-trees")
    args = _build_parser().parse_args(["up", "--model", str(tiny_llama_folder), "--draft", "ngram", "--no-token-trees"])
    with pytest.raises(SystemExit, match="--no-token-trees goes with --draft default or phrases:PATH"):
        _run_up(args)


@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--num-speculative-tokens", "-1"], "--num-speculative-tokens must be at least 0"),
        (["--max-model-len", "0"], "--max-model-len must be at least 1"),
        (["--max-model-len", "100000"], "exceeds the model's 128 positions"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be at least 1"),
        (["--kv-cache-memory", "0"], "--kv-cache-memory must be positive"),
        (["--spec-draft-token-budget", "-3"], "--spec-draft-token-budget must be at least 0"),
        (["--num-workers", "0"], "--num-workers must be at least 1"),
        (["--port", "8000", "--http-port", "8000"], "--port and --http-port are both 8000"),
        (["--port", "0"], "--port must be a port number"),
        (["--device", "tpu"], "--device tpu: expected cpu or cuda"),
        (
            ["--draft", "default"],
            "was trained for a target with another vocabulary",
        ),  # the shipped draft is the default model's
        (["--keys", "/no/such/keys"], "--keys /no/such/keys: no such folder"),
        (["--keys", "/tmp", "--insecure-loopback"], "--keys and --insecure-loopback exclude each other"),
        (["--prefix-cache-scope", "tenant"], "tenants are told apart by their API keys, and none is given"),
        (["--api-key-file", "/no/such/api-keys"], "--api-key-file /no/such/api-keys: cannot be read"),
        (["--tls-keyfile", "/no/such/key.pem"], "--tls-certfile and --tls-keyfile go together"),
        (["--allowed-origins", "app.example"], "--allowed-origins: 'app.example' is not an origin"),
    ],
)
def test_up_refuses_what_cannot_work_before_any_process_starts(
    tiny_llama_folder: Path, flags: list[str], problem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import specserve.cli
    import specserve.up_run

    monkeypatch.setattr(specserve.up_run, "Supervisor", None)  # starting anything would fail loudly
    monkeypatch.delenv("SPECSERVE_API_KEY", raising=False)
    args = _build_parser().parse_args(["up", "--model", str(tiny_llama_folder), *flags])
    with pytest.raises(SystemExit, match=problem.replace("+", "\\+")):
        specserve.cli._run_up(args)


def test_up_gives_up_when_nothing_serves_within_the_ready_timeout(
    tiny_llama_folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import specserve.cli
    import specserve.up_run

    stopped: list[float] = []

    class NeverReady:  # a stack whose target never becomes READY
        stopping = False

        def __init__(self, specs: object, policy: object) -> None: ...
        def install_signal_handlers(self) -> None: ...
        def start(self) -> None: ...

        def watch(self, until: Any = None, poll_s: float = 0.2) -> None:
            while until is not None and not until():
                time.sleep(0.01)

        def stop(self, grace_s: float) -> None:
            stopped.append(grace_s)

    monkeypatch.setattr(specserve.up_run, "Supervisor", NeverReady)
    monkeypatch.setattr(specserve.up_run, "stack_serving", lambda config, addresses: False)
    args = _build_parser().parse_args(
        ["up", "--model", str(tiny_llama_folder), "--draft", "ngram", "--ready-timeout-s", "0.2"]
    )
    assert specserve.cli._run_up(args) == 1
    assert stopped and "not serving within 0.2 s (--ready-timeout-s)" in capsys.readouterr().err


def test_the_draft_service_checks_its_proposer_arguments() -> None:
    from draft_service.config import DraftConfig, add_arguments, from_arguments

    def config(*argv: str) -> DraftConfig:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return from_arguments(parser.parse_args([*argv, "--insecure-loopback"]))

    both = config("--proposer", "eagle+ngram:/d", "--target-model", "/t", "--head-draft-tokens", "2")
    assert both.proposer == DraftSpec(DraftKind.EAGLE_NGRAM, Path("/d")) and both.head_draft_tokens == 2
    assert both.proposer.model_path == Path("/d") and both.process.worker_id == "draft-0"
    assert (
        both.token_trees
        and not config("--proposer", "phrases:/d", "--target-model", "/t", "--no-token-trees").token_trees
    )
    with pytest.raises(ValueError, match="needs --target-model"):
        config("--proposer", "eagle+ngram:/d")
    assert config("--proposer", "phrases:/d", "--target-model", "/t").proposer.model_path == Path("/d")
    with pytest.raises(ValueError, match="needs --target-model"):
        config("--proposer", "phrases:/d")
    for kind in ("eagle+phrases", "eagle+ngram"):
        assert config("--proposer", f"{kind}:/d", "--target-model", "/t").proposer.runs_model
    assert not config("--proposer", "phrases:/d", "--target-model", "/t").proposer.runs_model
    with pytest.raises(ValueError, match="--head-draft-tokens"):
        config("--proposer", "eagle+ngram:/d", "--target-model", "/t", "--head-draft-tokens", "0")
    with pytest.raises(ValueError, match="--proposer 'tree:/d'"):
        config("--proposer", "tree:/d")
    assert config("--proposer", "random:49152").proposer == DraftSpec(DraftKind.RANDOM, vocab_size=49152)


def test_a_draft_spec_is_parsed_once_and_says_what_its_kind_needs() -> None:
    for text in (
        "ngram",
        "phrases:/d",
        "eagle:/d",
        "eagle+ngram:/d",
        "eagle+phrases:/d",
        "model:/d",
        "random:7",
        "replay:/f.json",
    ):
        assert str(DraftSpec.parse(text, flag="--proposer")) == text
    for bad in ("", "ngram:x", "eagle", "model:", "random:x", "tree:/d"):
        with pytest.raises(ValueError, match=f"--proposer {bad!r}"):
            DraftSpec.parse(bad, flag="--proposer")
    with pytest.raises(ValueError, match="--draft 'replay:/f'"):
        DraftSpec.parse("replay:/f", flag="--draft", kinds=(DraftKind.NGRAM, DraftKind.MODEL))
    head = DraftSpec.parse("eagle+phrases:/d", flag="--draft")
    assert head.runs_model and head.needs_target_model and head.lookup_then_head and not head.proposes_trees
    phrases = DraftSpec.parse("phrases:/d", flag="--draft")
    assert phrases.proposes_trees and phrases.needs_target_model and not phrases.runs_model
    model = DraftSpec.parse("model:/d", flag="--draft")
    assert model.runs_model and not model.needs_target_model and model.model_path == Path("/d")
    assert DraftSpec.parse("replay:/f", flag="--proposer").model_path is None


def test_up_resolves_its_flags_once_into_a_frozen_config_and_leaves_them_as_they_are(tiny_llama_folder: Path) -> None:
    import dataclasses

    from specserve.up import up_config

    args = _build_parser().parse_args(["up", "--model", str(tiny_llama_folder), "--draft", "ngram", "--device", "cpu"])
    given = dict(vars(args))
    config = up_config(args)
    assert vars(args) == given
    stack = config.stack
    # Speculation's caps not given: the scheduler decides them from the draft's hello.
    assert (stack.max_model_len, stack.num_speculative_tokens, stack.spec_disable_batch_threshold) == (128, None, None)
    assert stack.draft == DraftSpec(DraftKind.NGRAM) and config.draft_name == "ngram" and stack.device == "cpu"
    with pytest.raises(dataclasses.FrozenInstanceError):
        stack.num_workers = 2  # type: ignore[misc]


def test_every_service_is_given_the_key_folder() -> None:
    argvs = _service_argvs("--draft", "ngram", model=Path("/m"))
    assert set(argvs) == {"scheduler", "worker-0", "draft", "gateway"}
    for argv in argvs.values():
        assert argv[argv.index("--keys") + 1] == "/keys" and "--insecure-loopback" not in argv


def test_up_without_keys_given_makes_a_private_folder_for_its_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import specserve.up
    import specserve.up_run

    seen: list[tuple[str, ...]] = []

    def supervise(config: object, stack: object) -> int:
        keys = stack.keys  # type: ignore[attr-defined]
        seen.append(tuple(sorted(p.relative_to(keys).as_posix() for p in keys.rglob("*.key*"))))
        assert keys.stat().st_mode & 0o777 == 0o700
        return 0

    monkeypatch.setattr(specserve.up_run, "_supervise", supervise)
    args = _build_parser().parse_args(["up", "--keys", "/unused"])
    config = stack_config(args, model=tmp_path, max_model_len=64, draft=None, device="cpu", dtype="float32")
    up = specserve.up.UpConfig(stack=dataclasses.replace(config, keys=None), draft_name="none", ready_timeout_s=1.0)
    assert specserve.up_run.run_up(up) == 0
    assert seen == [
        (
            "authorized/gateway/gateway.key",
            "authorized/worker/worker.key",
            "gateway.key",
            "gateway.key_secret",
            "scheduler.key",
            "scheduler.key_secret",
            "worker.key",
            "worker.key_secret",
        )
    ]
