"""The parts run on a served stack: greedy against Hugging Face, the capture fault, throughput, and a worker killed
mid-stream."""

from __future__ import annotations

import asyncio
import math
import signal
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

import grpc

from bench.device_check.model import Reference, compare
from bench.device_check.report import Budget, Outcome, Sizes
from bench.device_check.stacks import Served, in_state, wait_for
from bench.grpc_load import RequestFactory, RequestFailure, RequestRecord, Workload, build_request, run_requests
from bench.grpc_load import summarize
from bench.prompts import PromptWindows
from proto import specserve_pb2 as pb
from proto import specserve_pb2_grpc as pb_grpc

SUPERVISOR_FIRST_PAUSE_S = 1.0  # `specserve up` restarts a crashed process after 1 s, then longer


def greedy(served: Served, refs: list[Reference], budget: Budget) -> Outcome[None]:
    """Each prompt alone, then all at once (a batch that graphs pad to their bucket), against Hugging Face."""
    if not refs:
        raise RuntimeError("no Hugging Face references to compare with (the references part says why)")
    num_tokens = len(refs[0].token_ids)
    timeout_s = max(10.0, budget.left_s())
    alone = [served.generate(ref.prompt_ids, num_tokens, timeout_s) for ref in refs]
    with ThreadPoolExecutor(len(refs)) as pool:
        together = list(pool.map(lambda ref: served.generate(ref.prompt_ids, num_tokens, timeout_s), refs))
    rows: list[dict[str, Any]] = [
        {
            "prompt": ref.prompt[:60],
            "alone": compare(ref, a),
            "together": compare(ref, b),
            "hf_min_margin": round(min(ref.margins), 5),  # how near Hugging Face's own answer came to a tie
        }
        for ref, a, b in zip(refs, alone, together)
    ]
    verdicts = [row[way]["verdict"] for row in rows for way in ("alone", "together")]
    counts = {verdict: verdicts.count(verdict) for verdict in ("equal", "tie", "differs")}
    return Outcome(
        counts["differs"] == 0,
        {
            "num_prompts": len(refs),
            "num_tokens": num_tokens,
            "verdicts": counts,
            "targets": served.targets(),
            "rows": rows,
        },
    )


# ---------------------------------------------------------------- capture fault


def capture_fault(served: Served, budget: Budget) -> Outcome[None]:
    """Two more workers whose second capture raises: with graphs on it must end FAILED, never READY (its log never
    says READY, and no step reached it, not even one refused); with fallback it must be READY and say it serves
    eagerly."""
    stack = served.stack
    faulty, fallback = "capture-fault", "capture-fallback"
    stack.start_worker(faulty, ("--cuda-graphs", "on"), fault=f"worker-{faulty}:capture=2:raise")
    stack.start_worker(fallback, ("--cuda-graphs", "fallback"), fault=f"worker-{fallback}:capture=2:raise")
    timeout_s = max(10.0, min(150.0, budget.left_s()))
    started = time.monotonic()
    failed = wait_for("the faulty worker FAILED", timeout_s, in_state(served, f"worker-{faulty}", ("FAILED", "DEAD")))
    failed_s = time.monotonic() - started
    eager = wait_for(
        "the fallback worker READY", timeout_s, in_state(served, f"worker-{fallback}", ("READY", "FAILED", "DEAD"))
    )
    exit_code = stack.processes[f"worker-{faulty}"].wait(30)
    log = (stack.log_dir / f"worker-{faulty}.log").read_text(errors="replace")
    checks = {
        "faulty_failed": failed.state == "FAILED",
        "failure_names_the_capture": "CaptureFailed" in failed.failure and "capturing graph 2 of" in failed.failure,
        "faulty_never_ready": "READY" not in log,
        "faulty_got_no_step": "seq.started" not in log and "step.refused" not in log,
        "faulty_exited_non_zero": exit_code != 0,
        "fallback_ready": eager.state == "READY",
        "fallback_serves_eagerly": eager.graphs.startswith("fallback: eager"),
    }
    return Outcome(
        all(checks.values()),
        {
            "checks": checks,
            "faulty": {"state": failed.state, "failure": failed.failure, "exit_code": exit_code},
            "faulty_failed_after_s": round(failed_s, 1),
            "fallback": {"state": eager.state, "graphs": eager.graphs, "failure": eager.failure},
        },
    )


# ---------------------------------------------------------------- throughput


def throughput(
    served: Served, prompts: PromptWindows, sizes: Sizes, concurrencies: Sequence[int], draft: str, budget: Budget
) -> Outcome[None]:
    """Output tokens/s at each concurrency (requests of fixed length, greedy, ignore_eos, each a new prompt), after
    two warm-up requests; the speculation counters after."""
    workload = Workload(sizes.input_tokens, sizes.output_tokens, None, None, max(10.0, budget.left_s()))

    async def measure() -> list[dict[str, Any]]:
        runs = []
        async with grpc.aio.insecure_channel(served.address) as channel:
            stub = pb_grpc.SpecServeStub(channel)
            requests = RequestFactory(prompts, sizes.output_tokens, prefix="device-check")
            await run_requests(stub, requests.take("warmup", 2), 2, workload)
            for concurrency in concurrencies:
                taken = requests.take(f"c{concurrency}", workload.num_requests(concurrency))
                results, duration_s = await run_requests(stub, taken, concurrency, workload)
                records = [r for r in results if isinstance(r, RequestRecord)]
                failures = [r.reason for r in results if isinstance(r, RequestFailure)]
                summary = asdict(summarize(concurrency, records, duration_s)) if records else {}
                runs.append(
                    {
                        "concurrency": concurrency,
                        **rounded(summary),
                        "num_failed": len(failures),
                        "failures": failures[:3],
                    }
                )
        return runs

    runs = asyncio.run(measure())
    speculation = served.info().speculation
    counters = {
        "num_draft_tokens": speculation.num_draft_tokens,
        "acceptance_rate": round(speculation.acceptance_rate, 3),
        "mean_accepted_length": round(speculation.mean_accepted_length, 3),
        "num_verify_steps": speculation.num_verify_steps,
    }
    return Outcome(
        all(run["num_failed"] == 0 for run in runs),
        {"draft": draft, "runs": runs, "speculation": counters, "targets": served.targets()},
    )


def rounded(values: dict[str, Any]) -> dict[str, Any]:
    """Floats to 3 decimals, NaN (a figure of no requests) to None: JSON has no NaN."""
    return {
        key: (None if math.isnan(value) else round(value, 3)) if isinstance(value, float) else value
        for key, value in values.items()
    }


# ---------------------------------------------------------------- a worker killed mid-stream


def kill_worker(served: Served, prompts: PromptWindows, sizes: Sizes, budget: Budget) -> Outcome[None]:
    """SIGKILL worker-0 once every stream has tokens and none has finished, restart it after the supervisor's first
    pause; every request must still complete with all its tokens."""
    stack = served.stack
    num_streams, num_tokens = sizes.num_kill_requests, sizes.kill_tokens
    requests = [build_request(f"kill-{i}", prompts.prompt_token_ids(500 + i), num_tokens) for i in range(num_streams)]
    received = [0] * num_streams
    timeout_s = max(30.0, budget.left_s())

    def stream(index: int) -> str:
        """Empty when the request completed with all its tokens, else what went wrong."""
        try:
            for chunk in served.stub.Generate(requests[index], timeout=timeout_s):
                received[index] += len(chunk.token_ids)
        except grpc.RpcError as error:
            return f"{error.code().name}: {error.details()}"
        return "" if received[index] == num_tokens else f"{received[index]} tokens, not {num_tokens}"

    before = served.process("worker-0")
    if before is None or before.state != "READY":
        raise RuntimeError(f"worker-0 is not READY before the kill: {before}")
    old_incarnation = before.incarnation

    def back_again() -> pb.Process | None:
        process = served.process("worker-0")
        ready = process is not None and process.state == "READY" and process.incarnation != old_incarnation
        return process if ready else None

    with ThreadPoolExecutor(num_streams) as pool:
        futures = [pool.submit(stream, i) for i in range(num_streams)]
        mid_stream = min(8, num_tokens // 4)
        wait_for(
            "every stream streaming",
            60,
            lambda: True if min(received) >= mid_stream or any(f.done() for f in futures) else None,
        )
        tokens_at_kill = list(received)
        worker = stack.processes["worker-0"]
        worker.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        worker.wait()
        time.sleep(SUPERVISOR_FIRST_PAUSE_S)
        stack.start_worker(0)
        back = wait_for("worker-0 READY again", max(10.0, budget.left_s()), back_again)
        ready_s = time.monotonic() - killed_at
        errors = [future.result() for future in futures]
        done_s = time.monotonic() - killed_at
    failures = [error for error in errors if error]
    return Outcome(
        not failures and min(tokens_at_kill) > 0 and max(tokens_at_kill) < num_tokens,
        {
            "num_requests": num_streams,
            "num_tokens": num_tokens,
            "num_completed": num_streams - len(failures),
            "num_failed": len(failures),
            "failures": failures[:3],
            "tokens_at_kill": tokens_at_kill,
            "worker_ready_again_s": round(ready_s, 1),
            "all_done_s": round(done_s, 1),
            "graphs_after_restart": back.graphs,
        },
    )
