"""Speculation as a user gets it: the default (goodput) policy on the native kernels, and speculation on torch's ops.

On the native kernels a step's rows are batch invariant, so whatever the policy decides,
every greedy answer is plain decoding's, token for token. On torch's ops (as on a GPU)
they are not: the worker says so, drafts are still verified (lossless in distribution),
and a greedy answer may differ from plain decoding's where two logits are within rounding
of each other; the share that agrees is printed, and every answer must be well formed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.text.tokenizer import Tokenizer
from specserve.stack import StackConfig
from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_speculation import NUM_TOKENS, prompt_ids, request, run_staggered, switch_draft

VOCAB_SIZE = 49152


def _speculation_delta(stack: Stack, before: object) -> tuple[int, int]:
    after = stack.wait_idle().speculation
    return (
        after.num_draft_tokens - before.num_draft_tokens,  # type: ignore[attr-defined]
        after.num_accepted_draft_tokens - before.num_accepted_draft_tokens,
    )  # type: ignore[attr-defined]


@pytest.mark.skipif(os.environ.get("SPECSERVE_NATIVE_OPS") == "0", reason="on torch ops steps are not batch invariant")
def test_the_goodput_policy_decides_from_what_it_measured_and_changes_no_greedy_answer(
    default_model_dir: Path, tmp_path: Path
) -> None:
    options = StackConfig(
        default_model_dir,
        dtype="float32",
        num_workers=1,
        max_num_seqs=8,
        scheduler_args=("--num-speculative-tokens", "4", "--spec-disable-batch-threshold", "8"),
    )
    ids = prompt_ids(Tokenizer.load(default_model_dir))
    requests = [request(p) for p in ids]
    with running_stack(options, tmp_path) as stack:
        switch_draft(stack, None)
        baseline = [r.token_ids for r in run_staggered(stack, requests)]
        switch_draft(stack, "ngram")
        for _ in range(2):  # the second pass starts from what the first taught it
            before = stack.info().speculation
            results = run_staggered(stack, requests)
            assert [r.token_ids for r in results] == baseline
            proposed, accepted = _speculation_delta(stack, before)
            print(f"goodput policy, prompt lookup: {accepted} of {proposed} draft tokens accepted")
        info = stack.info()
        spec = info.speculation
        assert spec.policy == "goodput"
        target = next(p for p in info.processes if p.role == "target")
        # Its warm-up timings and every step since fed the fit; the steps' predictions are shown beside what they took.
        assert target.batch_invariant and target.num_costed_steps > 100 and target.step_measured_ms > 0
        assert target.step_predicted_ms > 0 and target.step_ms_per_row > 0
        sources = {entry.source: entry for entry in spec.sources}
        # The repetitive prompts' lookups are verified: their record is kept apart, per position.
        assert "lookup" in sources and sources["lookup"].num_verify_steps > 0 and sources["lookup"].recent_rates


@pytest.mark.parametrize("required", [False, True])
def test_on_torch_ops_drafts_are_verified_unless_batch_invariance_is_required(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, required: bool
) -> None:
    monkeypatch.setenv("SPECSERVE_NATIVE_OPS", "0")  # every process the stack starts runs torch's ops
    options = StackConfig(
        default_model_dir,
        dtype="float32",
        num_workers=1,
        max_num_seqs=8,
        speculation_policy="fixed",
        require_batch_invariance=required,
        scheduler_args=("--num-speculative-tokens", "4", "--spec-disable-batch-threshold", "8"),
    )
    ids = prompt_ids(Tokenizer.load(default_model_dir))
    requests = [request(p) for p in ids]
    with running_stack(options, tmp_path) as stack:
        target = next(p for p in stack.info().processes if p.role == "target")
        assert target.HasField("batch_invariant") and not target.batch_invariant and target.kernels.startswith("torch")
        switch_draft(stack, None)
        baseline = [r.token_ids for r in run_staggered(stack, requests)]
        switch_draft(stack, "ngram")
        before = stack.info().speculation
        results = [r.token_ids for r in run_staggered(stack, requests)]
        proposed, accepted = _speculation_delta(stack, before)
    assert all(len(tokens) == NUM_TOKENS and all(0 <= t < VOCAB_SIZE for t in tokens) for tokens in results)
    if required:
        assert proposed == 0 and results == baseline  # no drafts: plain decoding's very answers
        return
    assert proposed > 0 and accepted > 0, f"{accepted} of {proposed} draft tokens accepted"
    same = sum(r == b for r, b in zip(results, baseline))
    print(
        f"torch ops: {accepted} of {proposed} draft tokens accepted; {same} of {len(results)} greedy answers "
        f"identical to plain decoding's"
    )
