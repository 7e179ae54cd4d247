"""Which draft `specserve up` runs, and with which arguments, for the drafts a user can name."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import pytest

from modeling.model_store import default_draft_dir
from specserve.cli import _build_parser, _default_draft, _default_spec_threshold, _draft_choice, _draft_proposer, _service_specs


def test_the_shipped_draft_is_the_default_only_for_the_model_it_was_trained_for(default_model_dir: Path,
                                                                                 tiny_llama_folder: Path) -> None:
    assert _default_draft(default_model_dir) == "default"
    assert _default_draft(tiny_llama_folder) == "ngram"
    assert _draft_proposer("default") == f"phrases:{default_draft_dir()}"


def test_an_install_without_the_drafts_folder_falls_back_to_prompt_lookup(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import modeling.model_store

    monkeypatch.setattr(modeling.model_store, "default_draft_dir", lambda: tmp_path / "not-installed")
    assert _default_draft(default_model_dir) == "ngram"


def test_lookups_speculate_in_larger_steps_than_drafts_that_run_a_model() -> None:
    for proposer in ("ngram", "phrases:/d", _draft_proposer("default")):
        assert _default_spec_threshold(proposer) == 16
    for proposer in ("eagle:/d", "eagle+ngram:/d", "eagle+phrases:/d", "model:/d"):
        assert _default_spec_threshold(proposer) == 4


def test_draft_names_are_checked_and_heads_get_the_target(tmp_path: Path) -> None:
    for good in ("none", "ngram", "default", "phrases:x", "eagle:x", "eagle+ngram:x", "eagle+phrases:x", "model:x"):
        assert _draft_choice(good) == good
    for bad in ("eagle", "eagle+ngram:", "phrases", "ngram:x", "tree:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            _draft_choice(bad)
    for kind in ("eagle+ngram", "eagle+phrases", "phrases"):
        args = _build_parser().parse_args(["up", "--draft", f"{kind}:{tmp_path}"])
        args.num_speculative_tokens, args.spec_disable_batch_threshold = 6, 4
        specs = {spec.name: spec.argv for spec in _service_specs(args, tmp_path / "model", "cpu", "bfloat16")}
        scheduler = specs["scheduler"]
        assert scheduler[scheduler.index("--spec-draft-token-budget") + 1] == "32"
        command = specs["draft"]
        assert command[command.index("--proposer") + 1] == f"{kind}:{tmp_path.resolve()}"
        assert command[command.index("--target-model") + 1] == str(tmp_path / "model")
        assert "--head-draft-tokens" not in command  # unless told: the draft service's own default


def test_the_heads_proposal_length_reaches_the_draft_service(tmp_path: Path) -> None:
    args = _build_parser().parse_args(["up", "--draft", f"eagle+phrases:{tmp_path}", "--head-draft-tokens", "1"])
    args.num_speculative_tokens, args.spec_disable_batch_threshold = 6, 4
    command = {spec.name: spec.argv for spec in _service_specs(args, tmp_path / "model", "cpu", "bfloat16")}["draft"]
    assert command[command.index("--head-draft-tokens") + 1] == "1"
    assert command[command.index("--max-draft-tokens") + 1] == "6"  # a lookup's proposal may still reach k


@pytest.mark.parametrize("draft, head_draft_tokens", [("ngram", "1"), ("eagle:{dir}", "1"), ("eagle+phrases:{dir}", "0")])
def test_head_draft_tokens_is_refused_before_anything_starts_where_it_means_nothing(
        tiny_llama_folder: Path, tmp_path: Path, draft: str, head_draft_tokens: str) -> None:
    from specserve.cli import _run_up

    args = _build_parser().parse_args(["up", "--model", str(tiny_llama_folder), "--draft", draft.format(dir=tmp_path),
                                       "--head-draft-tokens", head_draft_tokens])
    with pytest.raises(SystemExit, match="--head-draft-tokens must be at least 1, with --draft eagle\\+ngram:PATH"):
        _run_up(args)


def test_token_trees_are_on_unless_turned_off_and_only_phrases_take_the_switch(
        tiny_llama_folder: Path, tmp_path: Path) -> None:
    from specserve.cli import _run_up

    def draft_command(*argv: str) -> list[str]:
        args = _build_parser().parse_args(["up", *argv])
        args.num_speculative_tokens, args.spec_disable_batch_threshold = 6, 16
        return {spec.name: spec.argv for spec in _service_specs(args, tmp_path / "model", "cpu", "bfloat16")}["draft"]

    assert "--no-token-trees" not in draft_command("--draft", "default")
    assert "--no-token-trees" in draft_command("--draft", "default", "--no-token-trees")
    args = _build_parser().parse_args(["up", "--model", str(tiny_llama_folder), "--draft", "ngram", "--no-token-trees"])
    with pytest.raises(SystemExit, match="--no-token-trees goes with --draft default or phrases:PATH"):
        _run_up(args)


@pytest.mark.parametrize("flags, problem", [
    (["--num-speculative-tokens", "-1"], "--num-speculative-tokens must be at least 0"),
    (["--max-model-len", "0"], "--max-model-len must be at least 1"),
    (["--max-model-len", "100000"], "exceeds the model's 128 positions"),
    (["--num-kv-slots", "0"], "--num-kv-slots must be at least 1"),
    (["--spec-draft-token-budget", "-3"], "--spec-draft-token-budget must be at least 0"),
    (["--num-workers", "0"], "--num-workers must be at least 1"),
    (["--port", "8000", "--http-port", "8000"], "--port and --http-port are both 8000"),
    (["--port", "0"], "--port must be a port number"),
    (["--device", "tpu"], "--device tpu: expected cpu or cuda"),
    (["--draft", "default"], "was trained for a target with another vocabulary"),  # the shipped draft is the default model's
])
def test_up_refuses_what_cannot_work_before_any_process_starts(tiny_llama_folder: Path, flags: list[str], problem: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import specserve.cli

    monkeypatch.setattr(specserve.cli, "Supervisor", None)  # starting anything would fail loudly
    args = _build_parser().parse_args(["up", "--model", str(tiny_llama_folder), *flags])
    with pytest.raises(SystemExit, match=problem.replace("+", "\\+")):
        specserve.cli._run_up(args)


def test_up_gives_up_when_nothing_serves_within_the_ready_timeout(tiny_llama_folder: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import specserve.cli

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

    monkeypatch.setattr(specserve.cli, "Supervisor", NeverReady)
    monkeypatch.setattr(specserve.cli, "_is_serving", lambda host, port: False)
    args = _build_parser().parse_args(["up", "--model", str(tiny_llama_folder), "--draft", "ngram", "--ready-timeout-s", "0.2"])
    assert specserve.cli._run_up(args) == 1
    assert stopped and "not serving within 0.2 s (--ready-timeout-s)" in capsys.readouterr().err


def test_the_draft_service_checks_its_proposer_arguments() -> None:
    from draft_service.config import DraftConfig, add_arguments, from_arguments

    def config(*argv: str) -> DraftConfig:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return from_arguments(parser.parse_args(list(argv)))

    both = config("--proposer", "eagle+ngram:/d", "--target-model", "/t", "--head-draft-tokens", "2")
    assert both.model_path == Path("/d") and both.head_draft_tokens == 2
    assert both.token_trees and not config("--proposer", "phrases:/d", "--target-model", "/t", "--no-token-trees").token_trees
    with pytest.raises(ValueError, match="needs --target-model"):
        config("--proposer", "eagle+ngram:/d")
    assert config("--proposer", "phrases:/d", "--target-model", "/t").model_path == Path("/d")
    with pytest.raises(ValueError, match="needs --target-model"):
        config("--proposer", "phrases:/d")
    for kind in ("eagle+phrases", "eagle+ngram"):
        assert config("--proposer", f"{kind}:/d", "--target-model", "/t").runs_model
    assert not config("--proposer", "phrases:/d", "--target-model", "/t").runs_model
    with pytest.raises(ValueError, match="--head-draft-tokens"):
        config("--proposer", "eagle+ngram:/d", "--target-model", "/t", "--head-draft-tokens", "0")
