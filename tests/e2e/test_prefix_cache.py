"""The paged KV cache through the whole stack: the prefix cache, preemption and speculation change no answer.

A workload of chats sharing a system prompt, first turns and then second turns that
repeat the first, is answered one request at a time by a stack that has none of it (no
prefix cache, no speculation, a pool that never runs out), and then concurrently by one
that has all of it: the prefix cache, the default draft, and a pool so small that
sequences are preempted and recomputed again and again. Every greedy answer must be the
same, token for token, in float32 and in bfloat16; the second stack must really have hit
its cache and preempted. A prompt larger than its pool is refused, naming the limit, and
the server serves on.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from common.draft_spec import DraftSpec
from modeling.model.config import ModelConfig
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE, page_bytes
from modeling.model.store import default_draft_dir
from common.text.tokenizer import ChatMessage, Tokenizer
from proto import specserve_pb2 as pb
from specserve.stack import StackConfig
from tests.e2e.stack import Stack, running_stack
from tests.e2e.test_http_api import call
from tests.machine import cpu_description

NUM_TOKENS = 24
CONCURRENCY = 8
POOL_PAGES = 28  # the crowded stack's whole KV cache: 448 positions for 8 requests of ~130-190 tokens

SYSTEM = (
    "You are the on-call assistant of a small infrastructure team. Answer in plain sentences, name the command "
    "or the file a reader should look at first, and say what you would check next if the first idea is wrong. "
    "Never invent a flag that does not exist."
)
QUESTIONS = [
    "Our web server returns 502 errors since this morning. Where do I start?",
    "A disk on the database host is at 95 percent. What is safe to delete?",
    "How do I find which process listens on port 8080?",
    "The nightly backup job did not run. How do I see why?",
    "Memory on the cache node grows every hour. Is that a leak?",
    "A colleague pushed a secret to the repository. What now?",
    "DNS lookups from one container time out. What do I check?",
    "How do I roll back the last deployment quickly?",
]
FIRST_ANSWER = "Start with the service's own log, then the load balancer's; the first error line names the cause."
FOLLOW_UP = "That did not show anything. What next?"


def _requests(tokenizer: Tokenizer) -> tuple[list[pb.GenerateRequest], list[pb.GenerateRequest]]:
    params = pb.SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    system = ChatMessage("system", SYSTEM)

    def request(messages: list[ChatMessage]) -> pb.GenerateRequest:
        return pb.GenerateRequest(token_ids=pb.TokenIds(ids=tokenizer.encode_chat(messages)), params=params)

    first = [request([system, ChatMessage("user", q)]) for q in QUESTIONS]
    second = [
        request(
            [system, ChatMessage("user", q), ChatMessage("assistant", FIRST_ANSWER), ChatMessage("user", FOLLOW_UP)]
        )
        for q in QUESTIONS
    ]
    return first, second


def _concurrently(stack: Stack, requests: list[pb.GenerateRequest]) -> list[tuple[list[int], int]]:
    gate = threading.Semaphore(CONCURRENCY)

    def run(request: pb.GenerateRequest) -> tuple[list[int], int]:
        with gate:
            result = stack.generate(request, timeout_s=600)
            return result.token_ids, result.cached_tokens

    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(run, requests))


@pytest.mark.skipif(os.environ.get("SPECSERVE_NATIVE_OPS") == "0", reason="on torch ops steps are not batch invariant")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_answers_are_the_same_with_and_without_the_prefix_cache_speculation_and_preemption(
    default_model_dir: Path, tmp_path: Path, dtype: str
) -> None:
    first, second = _requests(Tokenizer.load(default_model_dir))
    plain = StackConfig(default_model_dir, dtype=dtype, prefix_cache=False, num_speculative_tokens=0)
    (tmp_path / "plain").mkdir()
    (tmp_path / "crowded").mkdir()
    with running_stack(plain, tmp_path / "plain") as stack:
        expected = [stack.generate(r, timeout_s=300).token_ids for r in first + second]
        assert stack.info().processes[0].prefix_cache_hit_tokens == 0
        plain_kernels = next(p.kernels for p in stack.info().processes if p.role == "target")

    pool_gib = (
        POOL_PAGES
        * page_bytes(ModelConfig.from_folder(default_model_dir), DEFAULT_PAGE_SIZE, getattr(torch, dtype))
        / 2**30
    )
    crowded = StackConfig(
        default_model_dir,
        dtype=dtype,
        kv_cache_memory_gib=pool_gib,
        max_num_seqs=CONCURRENCY,
        draft=DraftSpec.parse(f"phrases:{default_draft_dir()}", flag="--draft"),
        num_speculative_tokens=6,
        spec_disable_batch_threshold=16,
        speculation_policy="fixed",
    )
    with running_stack(crowded, tmp_path / "crowded") as stack:
        got_first = _concurrently(stack, first)
        got_second = _concurrently(stack, second)
        info = stack.wait_idle()
        target = next(p for p in info.processes if p.role == "target")
        assert (target.num_kv_pages, target.kv_page_size) == (POOL_PAGES, DEFAULT_PAGE_SIZE)
        assert target.batch_invariant, f"{dtype}: the worker's steps are not batch invariant on {cpu_description()}"
        differ = [i for i, (got, want) in enumerate(zip(got_first + got_second, expected)) if got[0] != want]
        assert not differ, (
            f"{dtype}: requests {differ} differ from the plain stack's answers (plain: {plain_kernels}; "
            f"crowded: {target.kernels}; {target.num_preemptions} preemptions; {cpu_description()})"
        )
        assert target.num_preemptions > 0, "the pool was never short: nothing was preempted"
        assert target.prefix_cache_hit_tokens > 0 and info.speculation.num_accepted_draft_tokens > 0
        # The pool is small enough that cached pages are evicted, but the second turns still found some of theirs.
        assert sum(cached for _, cached in got_second) > 0

        huge = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[504] * (POOL_PAGES * DEFAULT_PAGE_SIZE + 1)),
            params=pb.SamplingParams(max_tokens=1),
        )
        with pytest.raises(grpc.RpcError) as refused:
            stack.generate(huge)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"holds {POOL_PAGES} pages" in refused.value.details() and "--kv-cache-memory" in refused.value.details()
        assert stack.generate(first[0]).token_ids == expected[0]  # and it serves on


def test_a_chats_second_turn_reuses_the_first_turns_pages_and_reports_them_in_usage(fp32_stack: Stack) -> None:
    """Two data-parallel workers, both idle: the second turn goes to the one holding the first turn's pages."""
    system = {"role": "system", "content": SYSTEM}
    question = {"role": "user", "content": QUESTIONS[1]}

    def chat(messages: list[dict[str, str]]) -> dict[str, Any]:
        status, body = call(
            fp32_stack,
            "POST",
            "/v1/chat/completions",
            {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0, "messages": messages},
        )
        assert status == 200 and isinstance(body, dict), body
        return body

    first = chat([system, question])
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    answer = first["choices"][0]["message"]
    second_turn = [
        system,
        question,
        {"role": "assistant", "content": answer["content"]},
        {"role": "user", "content": FOLLOW_UP},
    ]
    second = chat(second_turn)
    page = DEFAULT_PAGE_SIZE
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens"] // page * page <= cached < second["usage"]["prompt_tokens"]
    again = chat(second_turn)  # now wholly cached but its last page: the same answer
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= cached
    assert again["choices"][0]["message"] == second["choices"][0]["message"]
