"""Request behaviour through the gRPC API of a real stack: seeds, stop strings, cancellation, bad input."""

from __future__ import annotations

import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from modeling.kernels.packing import SWITCH_MARGIN
from proto import specserve_pb2 as pb
from tests.e2e.stack import Stack, collect


def _chat(content: str, **params: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=content)]),
        params=pb.SamplingParams(**params),
    )  # type: ignore[arg-type]


def test_seeded_sampling_is_reproducible_whatever_shares_the_batch(fp32_stack: Stack) -> None:
    seeded = _chat(
        "Tell me a short story about a robot.", max_tokens=32, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True
    )
    alone = fp32_stack.generate(seeded)
    others = [_chat(f"Count to {n}.", max_tokens=40, temperature=1.0, ignore_eos=True) for n in (5, 10, 20)]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(fp32_stack.generate, r) for r in others]
        time.sleep(0.2)  # the seeded request joins a batch already running
        crowded = fp32_stack.generate(seeded)
        for f in futures:
            f.result()
    assert crowded.token_ids == alone.token_ids
    other_seed = fp32_stack.generate(
        _chat(
            "Tell me a short story about a robot.", max_tokens=32, temperature=0.9, top_p=0.95, seed=43, ignore_eos=True
        )
    )
    assert other_seed.token_ids != alone.token_ids


def test_stop_string_is_cut_and_finishes(fp32_stack: Stack) -> None:
    free = fp32_stack.generate(_chat("Describe the water cycle in detail.", max_tokens=48, ignore_eos=True))
    words = free.text.split()
    stop = " " + words[len(words) // 2]
    cut = free.text[: free.text.index(stop)]
    stopped = fp32_stack.generate(
        _chat("Describe the water cycle in detail.", max_tokens=48, ignore_eos=True, stop=[stop])
    )
    assert stopped.text == cut
    assert stopped.finish_reason == pb.FINISH_REASON_STOP
    assert stopped.completion_tokens <= free.completion_tokens


def test_finish_reasons_and_usage(fp32_stack: Stack) -> None:
    length = fp32_stack.generate(
        pb.GenerateRequest(prompt="Hello", params=pb.SamplingParams(max_tokens=5, ignore_eos=True))
    )
    assert (length.finish_reason, length.completion_tokens, len(length.token_ids)) == (pb.FINISH_REASON_LENGTH, 5, 5)
    eos = fp32_stack.generate(_chat("What is the capital of France?", max_tokens=64))
    assert eos.finish_reason == pb.FINISH_REASON_STOP
    assert eos.token_ids[-1] == 2  # <|im_end|>
    ids = fp32_stack.generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[504, 2365, 6354]), params=pb.SamplingParams(max_tokens=3))
    )
    assert ids.prompt_tokens == 3


def test_cancelled_request_frees_its_kv_and_disturbs_no_other(fp32_stack: Stack) -> None:
    neighbour = _chat("Name five rivers.", max_tokens=40, ignore_eos=True)
    expected = fp32_stack.generate(neighbour)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(fp32_stack.generate, neighbour)
        call = fp32_stack.stub.Generate(_chat("Write a long essay about the ocean.", max_tokens=1000, ignore_eos=True))
        for num_chunks, _ in enumerate(call, start=1):
            if num_chunks == 3:
                call.cancel()
                break
        assert future.result().token_ids == expected.token_ids
    fp32_stack.wait_idle()


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_invalid_sampling_parameters_name_the_field(fp32_stack: Stack, params: dict[str, object], field: str) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        fp32_stack.generate(pb.GenerateRequest(prompt="Hi", params=pb.SamplingParams(**params)))  # type: ignore[arg-type]
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in raised.value.details()


def test_bad_inputs_are_invalid_argument(fp32_stack: Stack) -> None:
    for request, needle in [
        (pb.GenerateRequest(params=pb.SamplingParams(max_tokens=4)), "input"),
        (
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**7]), params=pb.SamplingParams(max_tokens=4)),
            "token_ids",
        ),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-3]), params=pb.SamplingParams(max_tokens=4)), "token_ids"),
    ]:
        with pytest.raises(grpc.RpcError) as raised:
            fp32_stack.generate(request)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert needle in raised.value.details()


def test_prompt_plus_max_tokens_past_the_context_names_both(fp32_stack: Stack) -> None:
    prompt_ids = list(range(1000, 1100))
    with pytest.raises(grpc.RpcError) as raised:
        fp32_stack.generate(
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), params=pb.SamplingParams(max_tokens=2000))
        )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = raised.value.details()
    assert "100" in details and "2000" in details and "2048" in details
    # The same request within the context is served, and the stack is unharmed.
    ok = fp32_stack.generate(
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt_ids), params=pb.SamplingParams(max_tokens=2))
    )
    assert ok.completion_tokens == 2


def test_no_ready_worker_is_unavailable_and_a_full_queue_resource_exhausted(no_worker_stack: Stack) -> None:
    request = pb.GenerateRequest(prompt="Hello", params=pb.SamplingParams(max_tokens=4))
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(no_worker_stack.generate, request) for _ in range(2)]
        deadline = time.monotonic() + 10
        while no_worker_stack.info().num_waiting < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as full:
            collect(no_worker_stack.stub.Generate(request, timeout=10))
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for future in waiting:
            with pytest.raises(grpc.RpcError) as unavailable:
                future.result()
            assert unavailable.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "no-worker-timeout-s" in unavailable.value.details()


def test_one_request_is_traced_through_every_process_log(fp32_stack: Stack) -> None:
    """The client's id finds the gateway's lines, whose `request.submitted` line names the id the scheduler and the
    workers know it by (never the client's own)."""
    request_id = "trace-me-0123456789"
    fp32_stack.generate(
        pb.GenerateRequest(prompt="Hello there", request_id=request_id, params=pb.SamplingParams(max_tokens=3))
    )
    logs = {p.stem: p.read_text() for p in fp32_stack.log_dir.glob("*.log")}
    assert {name for name, text in logs.items() if request_id in text} == {"gateway"}
    submitted = re.search(rf"request\.submitted .*request_id={request_id} scheduler_id=(\S+)", logs["gateway"])
    assert submitted, "no request.submitted line"
    found = {name for name, text in logs.items() if submitted.group(1) in text}
    assert {"gateway", "scheduler"} <= found
    assert any(name.startswith("worker-") for name in found), f"scheduler id only in {sorted(found)}"


def test_workers_run_on_the_native_kernels_and_say_so(fp32_stack: Stack, bf16_stack: Stack) -> None:
    """The end-to-end tests exercise the kernels, not a silent fallback to torch ops
    (modeling/kernels/native.py), on the path
    a probe measured fastest."""
    if os.environ.get("SPECSERVE_NATIVE_OPS") == "0":
        pytest.skip("SPECSERVE_NATIVE_OPS=0")
    for stack in (fp32_stack, bf16_stack):
        for log in stack.log_dir.glob("worker-*.log"):
            said = re.search(r"ops='?native \(linear kernel: (\w+), measured: ([^;]+); oneDNN", log.read_text())
            assert said, f"{log.name} does not run on the native kernels"
            measured = {path: float(ms) for path, ms in re.findall(r"(\w+) ([\d.e+-]+) ms", said.group(2))}
            chosen, first, fastest = said.group(1), next(iter(measured)), min(measured.values())
            # The probe keeps the first (widest) path unless another takes at most SWITCH_MARGIN of its time; the
            # log rounds the times to two digits, so the rule is checked with that much slack.
            slack = 1.1
            assert chosen in measured, said.group(0)
            if chosen == first:
                assert fastest * slack >= SWITCH_MARGIN * measured[first], said.group(0)
            else:
                assert measured[chosen] <= min(SWITCH_MARGIN * measured[first], fastest) * slack, said.group(0)


def test_each_target_shows_its_fitted_step_cost(fp32_stack: Stack) -> None:
    """The scheduler fits each target's step time to its steps (scheduler/speculation/cost.py) and shows the fit."""
    for index in range(4):
        fp32_stack.generate(
            pb.GenerateRequest(prompt=f"Count to {index + 5}.", params=pb.SamplingParams(max_tokens=12))
        )
    targets = [p for p in fp32_stack.info().processes if p.role == "target"]
    costed = [p for p in targets if p.num_costed_steps >= 8]
    assert costed, [(p.process_id, p.num_costed_steps) for p in targets]
    for process in costed:
        terms = (
            process.step_fixed_ms,
            process.step_ms_per_row,
            process.step_ms_per_prefill_token,
            process.step_ms_per_kilo_context,
        )
        assert min(terms) >= 0 and sum(terms) > 0 and 0 <= process.step_cost_error_ms < 1000, process
