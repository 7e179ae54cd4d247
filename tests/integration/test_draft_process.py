"""A real draft service process over a real ZeroMQ socket, the test acting as its scheduler.

Same lifecycle as a target worker: hello, every phase reported, work refused before
READY (never run later), proposals once READY, a failed start-up reported with its
phase and cause and a non-zero exit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec

from common.lifecycle_process import EXIT_DISMISSED
from proto import messages as m
from tests.integration.test_worker_process import GREEDY, FakeScheduler, scheduler  # noqa: F401  (fixture)


def _start_draft(proposer: str, address: str, tmp_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    log = (tmp_path / "draft.log").open("ab")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "draft_service",
            "--proposer",
            proposer,
            "--scheduler-address",
            address,
            "--dtype",
            "float32",
            "--num-seqs",
            "2",
            "--max-model-len",
            "128",
            "--max-draft-tokens",
            "3",
            "--status-file",
            str(tmp_path / "status"),
            "--insecure-loopback",
            *extra,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def test_a_draft_model_service_starts_in_phases_refuses_early_work_and_proposes(
    default_model_dir: Path,
    scheduler: FakeScheduler,
    tmp_path: Path,  # noqa: F811
) -> None:
    draft = _start_draft(f"model:{default_model_dir}", scheduler.address, tmp_path)
    try:
        hello = scheduler.receive(m.WorkerHello)
        assert isinstance(hello, m.WorkerHello)
        assert (hello.role, hello.vocab_size, hello.max_draft_tokens) == ("draft", 49152, 3)
        assert hello.num_kv_pages > 0 and hello.kv_page_size == 16
        assert hello.vocab_fingerprint
        prompt = [1, 504, 2365, 6354, 16438, 27003]
        scheduler.send(m.ProposeRequest(1, hello.incarnation, [m.ProposeSeq("r", 0, 0, prompt, 3, GREEDY)]))
        states: list[str] = []
        refused = None
        while "READY" not in states:
            message = scheduler.receive(msgspec.Struct)
            if isinstance(message, m.LifecycleReport):
                states.append(message.state)
            elif isinstance(message, m.ProposeRefused):
                refused = message
            elif isinstance(message, m.ProposeResult):
                raise AssertionError("a propose request sent before READY was answered")
        assert states == ["LOADING", "ALLOCATING", "WARMING", "READY"]
        assert refused is not None and refused.propose_id == 1 and "not READY" in refused.reason

        scheduler.send(m.ProposeRequest(2, hello.incarnation, [m.ProposeSeq("r", 0, 0, prompt, 3, GREEDY)]))
        result = scheduler.receive(m.ProposeResult)
        assert isinstance(result, m.ProposeResult) and result.propose_id == 2
        (proposal,) = result.proposals
        assert (proposal.num_held, len(proposal.token_ids)) == (len(prompt), 3)
        # The draft here is the target itself: its greedy proposal continues the prompt as the target would,
        # and the next request (one token accepted, one new) gets the continuation after that.
        scheduler.send(
            m.ProposeRequest(
                3,
                hello.incarnation,
                [
                    m.ProposeSeq("r", len(prompt) + 3, 2, [7], 3, GREEDY),
                ],
            )
        )
        second = scheduler.receive(m.ProposeResult)
        assert second.proposals[0].num_held == len(prompt) + 2  # type: ignore[attr-defined]

        # Counts that disagree restart the sequence; a wrong incarnation is refused.
        scheduler.send(m.ProposeRequest(4, hello.incarnation, [m.ProposeSeq("r", 99, 0, [8], 3, GREEDY)]))
        assert scheduler.receive(m.ProposeResult).proposals[0] == m.Proposal("r", 0, [])  # type: ignore[attr-defined]
        # Bad counts or tokens outside the vocabulary restart that sequence only; another incarnation's work is dropped.
        scheduler.send(m.ProposeRequest(5, hello.incarnation + 1, [m.ProposeSeq("r", 0, 0, prompt, 3, GREEDY)]))
        scheduler.send(
            m.ProposeRequest(
                6,
                hello.incarnation,
                [
                    m.ProposeSeq("r", 0, 0, prompt, 3, GREEDY),
                    m.ProposeSeq("bad", 0, -1, [49152], 3, GREEDY),
                ],
            )
        )
        answer = scheduler.receive(m.ProposeResult)
        assert answer.propose_id == 6  # type: ignore[attr-defined]
        assert [(p.num_held, len(p.token_ids)) for p in answer.proposals] == [(len(prompt), 3), (0, 0)]  # type: ignore[attr-defined]

        # An empty sequence (nothing held, nothing new) has nothing to continue: it starts over, the service lives on.
        scheduler.send(m.ProposeRequest(9, hello.incarnation, [m.ProposeSeq("empty", 0, 0, [], 3, GREEDY)]))
        assert scheduler.receive(m.ProposeResult).proposals[0] == m.Proposal("empty", 0, [])  # type: ignore[attr-defined]

        scheduler.send(m.ReleaseSequences(hello.incarnation, ["r"]))
        scheduler.send(m.Drain(hello.incarnation))
        assert draft.wait(30) == EXIT_DISMISSED
    finally:
        _stop(draft)


def test_a_draft_that_cannot_load_fails_in_its_phase_and_exits_non_zero(
    scheduler: FakeScheduler, tmp_path: Path
) -> None:  # noqa: F811
    replay = tmp_path / "broken.json"
    replay.write_text('{"not": "a list"}')
    draft = _start_draft(f"replay:{replay}", scheduler.address, tmp_path)
    try:
        scheduler.receive(m.WorkerHello)
        failed = scheduler.receive(m.WorkerFailed)
        assert isinstance(failed, m.WorkerFailed)
        assert (failed.phase, failed.error_type) == ("LOADING", "ValueError") and "token-id lists" in failed.message
        assert draft.wait(30) == 1
        assert (tmp_path / "status").read_text().splitlines()[0] == "FAILED"
    finally:
        _stop(draft)


def test_an_eagle_head_service_reads_target_features_and_refuses_another_target(
    tiny_llama_folder: Path,
    scheduler: FakeScheduler,
    tmp_path: Path,  # noqa: F811
) -> None:
    import json
    import shutil

    import torch

    from modeling.model.config import model_fingerprint
    from modeling.model.features import to_rows
    from tests.eagle_helpers import tiny_head

    folder = tmp_path / "head"
    tiny_head(tiny_llama_folder).save(folder, tiny_llama_folder, {"note": "untrained, for tests"})
    draft = _start_draft(f"eagle:{folder}", scheduler.address, tmp_path, "--target-model", str(tiny_llama_folder))
    try:
        hello = scheduler.receive(m.WorkerHello)
        assert isinstance(hello, m.WorkerHello)
        assert (hello.feature_width, hello.target_fingerprint) == (64, model_fingerprint(tiny_llama_folder))
        while scheduler.receive(m.LifecycleReport).state != "READY":  # type: ignore[attr-defined]
            pass
        tokens = [5, 17, 3, 88, 42, 7]
        features = to_rows(torch.randn(len(tokens) - 1, 64), 0)
        scheduler.send(m.ProposeRequest(1, hello.incarnation, [m.ProposeSeq("r", 0, 0, tokens, 3, GREEDY, features)]))
        (proposal,) = scheduler.receive(m.ProposeResult).proposals  # type: ignore[attr-defined]
        assert (proposal.num_held, len(proposal.token_ids)) == (len(tokens), 3)
        assert all(t % 2 == 0 for t in proposal.token_ids)  # the head's vocabulary: even ids
        # Feature rows that leave a gap restart the sequence; without features there is no proposal.
        gap = to_rows(torch.randn(1, 64), 9)
        scheduler.send(
            m.ProposeRequest(
                2,
                hello.incarnation,
                [m.ProposeSeq("r", 9, 3, [7], 3, GREEDY, gap), m.ProposeSeq("s", 0, 0, tokens, 3, GREEDY)],
            )
        )
        answer = scheduler.receive(m.ProposeResult)
        assert [(p.num_held, p.token_ids) for p in answer.proposals] == [(0, []), (len(tokens), [])]  # type: ignore[attr-defined]
        scheduler.send(m.Drain(hello.incarnation))
        assert draft.wait(30) == EXIT_DISMISSED
    finally:
        _stop(draft)

    other = tmp_path / "other_target"
    shutil.copytree(tiny_llama_folder, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(
        json.dumps({**config, "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0}})
    )
    refused = _start_draft(f"eagle:{folder}", scheduler.address, tmp_path, "--target-model", str(other))
    try:
        failed = scheduler.receive(m.WorkerFailed)
        assert isinstance(failed, m.WorkerFailed) and failed.error_type == "DraftMismatch"
        assert "trained for another target model" in failed.message
        assert refused.wait(30) == 1
    finally:
        _stop(refused)


def test_a_phrase_service_sends_token_trees_and_chains_when_told(
    tiny_llama_folder: Path,
    scheduler: FakeScheduler,
    tmp_path: Path,  # noqa: F811
) -> None:
    from common.text.phrases import PhraseStore
    from tests.eagle_helpers import tiny_head

    folder = tmp_path / "draft"
    tiny_head(tiny_llama_folder).save(folder, tiny_llama_folder, {"note": "untrained, for tests"})
    # After "1 2 3" the target wrote "4 5" twice and "6 7" once.
    PhraseStore.from_sequences([[1, 2, 3, 4, 5], [1, 2, 3, 6, 7], [1, 2, 3, 4, 5]]).save(folder)
    draft = _start_draft(f"phrases:{folder}", scheduler.address, tmp_path, "--target-model", str(tiny_llama_folder))
    try:
        hello = scheduler.receive(m.WorkerHello)
        assert isinstance(hello, m.WorkerHello)
        while scheduler.receive(m.LifecycleReport).state != "READY":  # type: ignore[attr-defined]
            pass
        sampled = m.SamplingParams(temperature=0.8, seed=2)
        context = [9, 1, 2, 3]
        scheduler.send(
            m.ProposeRequest(
                1,
                hello.incarnation,
                [m.ProposeSeq("g", 0, 0, context, 3, GREEDY), m.ProposeSeq("s", 0, 0, context, 3, sampled)],
            )
        )
        greedy, sampled_tree = scheduler.receive(m.ProposeResult).proposals  # type: ignore[attr-defined]
        assert (greedy.token_ids, greedy.parents) == ([4, 5, 6], [-1, 0, -1])
        assert (sampled_tree.token_ids, sampled_tree.parents, sampled_tree.dists) == ([4, 5, 6], [-1, 0, -1], None)
        # The service holds the tree's tokens in node order: the scheduler drops all three and sends the branch taken.
        scheduler.send(
            m.ProposeRequest(2, hello.incarnation, [m.ProposeSeq("g", len(context) + 3, 3, [6, 7], 3, GREEDY)])
        )
        (after,) = scheduler.receive(m.ProposeResult).proposals  # type: ignore[attr-defined]
        assert after.num_held == len(context) + 2
        scheduler.send(m.Drain(hello.incarnation))
        assert draft.wait(30) == EXIT_DISMISSED
    finally:
        _stop(draft)
    chains = _start_draft(
        f"phrases:{folder}", scheduler.address, tmp_path, "--target-model", str(tiny_llama_folder), "--no-token-trees"
    )
    try:
        hello = scheduler.receive(m.WorkerHello)
        while scheduler.receive(m.LifecycleReport).state != "READY":  # type: ignore[attr-defined]
            pass
        scheduler.send(m.ProposeRequest(1, hello.incarnation, [m.ProposeSeq("g", 0, 0, context, 3, GREEDY)]))  # type: ignore[attr-defined]
        (chain,) = scheduler.receive(m.ProposeResult).proposals  # type: ignore[attr-defined]
        assert (chain.token_ids, chain.parents) == ([4, 5], None)
        scheduler.send(m.Drain(hello.incarnation))  # type: ignore[attr-defined]
        assert chains.wait(30) == EXIT_DISMISSED
    finally:
        _stop(chains)
