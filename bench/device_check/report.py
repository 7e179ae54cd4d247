"""The check's sizes, its time budget, and its JSON summary: each part run within the budget and recorded."""

from __future__ import annotations

import json
import tarfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

LOG_TAIL_BYTES = 2 * 2**20

T = TypeVar("T")


@dataclass(frozen=True)
class Sizes:
    """How much each part does: the device's figures, or the dry run's (a CPU of two cores)."""

    device: str  # up's --device
    greedy_tokens: int  # tokens per greedy prompt
    input_tokens: int  # prompt tokens per throughput request
    output_tokens: int  # completion tokens per throughput request
    concurrencies: tuple[int, ...]
    num_kill_requests: int  # streams in flight when the worker is killed
    kill_tokens: int  # tokens each of them asks for
    up_flags: tuple[str, ...]  # given to every stack
    worker_args: tuple[str, ...]  # given to every target worker besides
    budget_s: float


DEVICE = Sizes(
    device="cuda",
    greedy_tokens=48,
    input_tokens=64,
    output_tokens=64,
    concurrencies=(1, 16, 64),
    num_kill_requests=16,
    kill_tokens=256,
    up_flags=("--kv-cache-memory", "8"),  # room beside it for the capture-fault part's two more workers
    worker_args=(),
    budget_s=420.0,
)
# The same parts, small enough for two cores: few tokens, sequences, positions and graph buckets (the
# recording backend runs every bucket's forward as it captures). Dense weights: the 4-bit blocks need the native
# kernels, and graphs replay torch's ops, as a GPU runs them.
DRY_RUN = Sizes(
    device="cpu",
    greedy_tokens=8,
    input_tokens=24,
    output_tokens=16,
    concurrencies=(1, 4),
    num_kill_requests=4,
    kill_tokens=32,
    up_flags=(
        *("--kv-cache-memory", "0.25", "--max-num-seqs", "4", "--max-model-len", "128"),
        *("--max-num-batched-tokens", "64", "--quantization", "none"),
    ),
    worker_args=("--max-draft-tokens", "2"),
    budget_s=330.0,
)


class Budget:
    """The check's time: a part that needs more than is left is skipped."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._started = time.monotonic()

    def elapsed_s(self) -> float:
        return time.monotonic() - self._started

    def left_s(self) -> float:
        return self.seconds - self.elapsed_s()


class Report:
    """The JSON summary, written again after every part so that a run cut short still leaves what it found."""

    def __init__(self, path: Path, budget: Budget, header: dict[str, Any]) -> None:
        self._path = path
        self._budget = budget
        self.header = header
        self.stacks: dict[str, dict[str, Any]] = {}
        self.parts: dict[str, dict[str, Any]] = {}

    def record(self, name: str, result: dict[str, Any]) -> None:
        self.parts[name] = result
        status = result["status"]
        print(f"[{self._budget.elapsed_s():5.0f} s] {name}: {status}", flush=True)
        self.write()

    def document(self) -> dict[str, Any]:
        statuses = {name: part["status"] for name, part in self.parts.items()}
        return {
            **self.header,
            "elapsed_s": round(self._budget.elapsed_s(), 1),
            "passed": bool(statuses) and all(status == "pass" for status in statuses.values()),
            "checks": statuses,
            "throughput": throughput_table(self.parts),
            "stacks": self.stacks,
            "parts": self.parts,
        }

    def write(self) -> None:
        self._path.write_text(json.dumps(self.document(), indent=1) + "\n")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    passed: bool
    details: dict[str, Any]  # what the summary says of the part
    value: T | None = None  # what later parts use of it


def run_part(report: Report, budget: Budget, name: str, need_s: float, body: Callable[[], Outcome[T]]) -> T | None:
    """Run one part unless the budget cannot hold it; its result, its failure or its skipping goes in the report.
    Returns the part's value for the parts after it (None unless it ran)."""
    if budget.left_s() < need_s:
        report.record(name, skipped(budget, need_s))
        return None
    started = time.monotonic()
    outcome: Outcome[T] | None = None
    try:
        outcome = body()
        result = {"status": "pass" if outcome.passed else "fail", **outcome.details}
    except Exception as error:  # a part's failure is its result; the next part runs
        result = {"status": "error", "error": describe_error(error)}
    report.record(name, {**result, "seconds": round(time.monotonic() - started, 1)})
    return None if outcome is None else outcome.value


def skipped(budget: Budget, need_s: float) -> dict[str, Any]:
    return {"status": "skipped", "reason": f"time budget: {budget.left_s():.0f} s left, the part needs {need_s:.0f} s"}


def describe_error(error: BaseException) -> str:
    """The exception and where it was raised; a StackError's message ends with every process's log, cut short."""
    text = f"{type(error).__name__}: {error}"
    where = traceback.format_exception(error)[-3:-1]
    return (text[:6000] + "\n" + "".join(where)).strip()


def throughput_table(parts: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Output tokens/s per concurrency: graphs on without a draft, with the default draft, graphs off; and the
    ratios of the last two to the first."""

    def rates(name: str) -> dict[int, float]:
        runs = parts.get(name, {}).get("runs", [])
        return {run["concurrency"]: run["output_tokens_per_s"] for run in runs if run.get("output_tokens_per_s")}

    none, draft, eager = (
        rates(f"throughput_graphs_{which}") for which in ("on_draft_none", "on_draft_default", "off_draft_none")
    )
    rows = []
    for concurrency in sorted(none.keys() | draft.keys() | eager.keys()):
        base = none.get(concurrency)
        row: dict[str, Any] = {"concurrency": concurrency, "graphs_on_draft_none": base}
        for label, figures in (("graphs_on_draft_default", draft), ("graphs_off_draft_none", eager)):
            rate = figures.get(concurrency)
            row[label] = rate
            row[f"{label}_ratio"] = round(rate / base, 3) if rate and base else None
        rows.append(row)
    return rows


def keep_logs(log_root: Path, archive: Path) -> None:
    """Every process's log (the end of a long one), in one archive beside the summary; never the stacks' keys."""
    logs = sorted(log_root.glob("*/*.log"))
    if not logs:
        return
    with tarfile.open(archive, "w:gz") as tar:
        for log in logs:
            size = log.stat().st_size
            info = tarfile.TarInfo(f"{log.parent.name}/{log.name}")
            info.size = min(size, LOG_TAIL_BYTES)
            with log.open("rb") as source:
                source.seek(size - info.size)
                tar.addfile(info, source)


def print_summary(document: dict[str, Any]) -> None:
    print("\n== device check:", "PASSED" if document["passed"] else "NOT PASSED", f"({document['elapsed_s']} s)")
    for name, status in document["checks"].items():
        print(f"  {name:38} {status}")
    parts = document["parts"]
    for name in ("greedy_graphs_on", "greedy_graphs_off"):
        if "verdicts" in parts.get(name, {}):
            print(f"  {name}: {parts[name]['verdicts']} (alone and together, {parts[name]['num_prompts']} prompts)")
    for row in document["throughput"]:
        print(
            f"  c={row['concurrency']}: {row['graphs_on_draft_none']} output tok/s (graphs, no draft); "
            f"default draft x{row['graphs_on_draft_default_ratio']}, graphs off x{row['graphs_off_draft_none_ratio']}"
        )
    if "all_done_s" in parts.get("kill_worker", {}):
        kill = parts["kill_worker"]
        print(
            f"  kill_worker: {kill['num_completed']}/{kill['num_requests']} completed, READY again after "
            f"{kill['worker_ready_again_s']} s, all done after {kill['all_done_s']} s"
        )
    for name, stack in document["stacks"].items():
        for target in stack.get("targets", []):
            print(f"  {name} {target['process_id']}: graphs {target['graphs']!r}")
