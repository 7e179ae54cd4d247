"""A request's greedy answer does not depend on what else the server is doing, nor on speculation.

24 real prompts (editing, chat and code) are answered one at a time, then all of them
with staggered arrivals at concurrency 8, where steps hold several sequences, prefill
chunks share steps with decodes, and (below the speculation threshold of 16 sequences)
verify steps carry drafts: without a draft, with the default draft (the shipped phrases
as token trees, and prompt lookup) and with n-gram lookup alone. Every answer must be
token for token the answer alone, in float32 and in bfloat16.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.spec_prompts import WORKLOADS
from common.text.tokenizer import ChatMessage, Tokenizer
from modeling.model.store import default_draft_dir
from proto import specserve_pb2 as pb
from specserve.stack import StackConfig
from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_speculation import switch_draft
from tests.machine import cpu_description

NUM_TOKENS = 32
CONCURRENCY = 8
STAGGER_S = 0.05


def _requests(model_dir: Path) -> list[pb.GenerateRequest]:
    tokenizer = Tokenizer.load(model_dir)
    prompts = [text for workload in WORKLOADS.values() for text in workload]
    assert len(prompts) == 24
    params = pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    return [
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=tokenizer.encode_chat([ChatMessage("user", text)])), params=params)
        for text in prompts
    ]


def _at_concurrency(stack: Stack, requests: list[pb.GenerateRequest]) -> list[list[int]]:
    """Every request, CONCURRENCY at a time, each arriving STAGGER_S after the one before."""
    slots = threading.Semaphore(CONCURRENCY)

    def run(index: int) -> list[int]:
        time.sleep(index * STAGGER_S)
        with slots:
            return stack.generate(requests[index], timeout_s=300).token_ids

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(run, range(len(requests))))


@pytest.mark.skipif(
    os.environ.get("SPECSERVE_NATIVE_OPS") == "0", reason="on torch ops a worker serves without speculation"
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_output_is_the_same_at_every_concurrency_with_and_without_speculation(
    default_model_dir: Path, tmp_path: Path, dtype: str
) -> None:
    options = StackConfig(
        default_model_dir,
        dtype=dtype,
        num_workers=1,
        max_num_seqs=CONCURRENCY,
        scheduler_args=("--num-speculative-tokens", "6", "--spec-disable-batch-threshold", "16"),
        speculation_policy="fixed",
    )
    with running_stack(options, tmp_path) as stack:
        requests = _requests(default_model_dir)
        alone = [stack.generate(r, timeout_s=300).token_ids for r in requests]
        assert all(len(tokens) == NUM_TOKENS for tokens in alone)
        for proposer in (None, f"phrases:{default_draft_dir()}", "ngram"):
            switch_draft(stack, proposer)
            before = stack.info().speculation
            crowded = _at_concurrency(stack, requests)
            differ = [i for i, (ours, expected) in enumerate(zip(crowded, alone)) if ours != expected]
            assert not differ, (
                f"{dtype}, draft {proposer}: requests {differ} of 24 differ from the same request alone "
                f"({[p.kernels for p in stack.info().processes if p.role == 'target']}; {cpu_description()})"
            )
            after = stack.wait_idle().speculation
            if proposer is not None:
                assert after.num_draft_tokens > before.num_draft_tokens, f"{proposer}: nothing was proposed"
                assert after.num_accepted_draft_tokens > before.num_accepted_draft_tokens, (
                    f"{proposer}: nothing accepted"
                )
