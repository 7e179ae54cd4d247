"""The kernels' thread team: a row's bits never depend on how many threads computed it, nor on a busy neighbour.

The native kernels share each call among the caller and helpers that join as the OS runs
them (modeling/kernels/csrc/team.h), so which thread computes which part of a step changes from
call to call, and more so while another process takes a core. Batch invariance must hold
whatever the count and whoever did the work: each case here runs beside a process that
keeps a core busy as well as alone, on 1, 2 and 3 threads (3: more threads than this
machine may have cores).
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.cpus import cgroup_cpu_quota, usable_cpus
from modeling.model.batch import SeqSpan
from modeling.kernels.packing import PackedLinear, block_probe
from modeling.kernels.invariance import linear_rows_problem
from modeling.kernels.native import KernelUnavailable, native_ops
from modeling.kernels.threads import compute_on, compute_threads, one_thread
from tests.unit.test_decoder_model import S, _kv, _random_model, _step

THREAD_COUNTS = (1, 2, 3)


@pytest.fixture(scope="module")
def ops():  # type: ignore[no-untyped-def]
    try:
        return native_ops()
    except KernelUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(params=["alone", "beside a busy process"])
def neighbour(request: pytest.FixtureRequest) -> Iterator[str]:
    """Nothing, or a process spinning at normal priority for the whole test."""
    if request.param == "alone":
        yield request.param
        return
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield request.param
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def threads_restored(ops) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """The thread counts as they were before the test, after it."""
    before = (torch.get_num_threads(), ops.get_num_threads())
    yield
    torch.set_num_threads(before[0])
    ops.set_num_threads(before[1])


def _steps(dtype: torch.dtype) -> list[torch.Tensor]:
    """Logits of a random model's steps: a prefill beside a decode, then a step of several decodes and a verify."""
    model = _random_model(dtype, 512)
    cache = _kv(model.config, 4, dtype)
    prompt = [(13 * i + 5) % 300 for i in range(150)]
    first = _step(model, cache, [SeqSpan(S(1), 0, prompt, 1), SeqSpan(S(2), 0, [7] * 40, 40)])
    second = _step(
        model, cache, [SeqSpan(S(1), 150, [3], 1), SeqSpan(S(2), 40, [4, 5, 6, 7, 8], 5), SeqSpan(S(3), 0, [9] * 20, 1)]
    )
    return [first, second]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_steps_rows_have_the_same_bits_on_any_number_of_threads(
    ops,
    neighbour: str,
    threads_restored: None,  # type: ignore[no-untyped-def]
    dtype: torch.dtype,
) -> None:
    with one_thread():
        expected = _steps(dtype)
    for threads in THREAD_COUNTS:
        compute_on(threads, native=True)
        assert compute_threads() == threads and torch.get_num_threads() == 1
        for _ in range(3):  # the helpers join at other points of each run
            for index, (ours, alone) in enumerate(zip(_steps(dtype), expected)):
                assert torch.equal(ours, alone), f"{neighbour}, {threads} threads: step {index}'s logits differ"


@pytest.mark.parametrize("block_format", [None, "q4_1", "q8_0"])
def test_every_row_of_a_call_is_the_row_alone_on_any_number_of_threads(
    ops,
    neighbour: str,
    threads_restored: None,  # type: ignore[no-untyped-def]
    block_format: str | None,
) -> None:
    """modeling/kernels/invariance.py's probe (every row count 1 .. 513, each row against itself alone),
    on each count."""
    linear = PackedLinear(ops)
    pack = linear.pack if block_format is None else block_probe(linear, block_format)
    for threads in THREAD_COUNTS:
        compute_on(threads, native=True)
        problem = linear_rows_problem(linear, pack, [576], torch.bfloat16, torch.device("cpu"))
        assert problem is None, f"{neighbour}, {threads} threads, {block_format or 'bfloat16'} weights: {problem}"


def _linear_in_child(
    threads: int, weight: torch.Tensor, rows: torch.Tensor, expected: torch.Tensor, out: "multiprocessing.Queue[bool]"
) -> None:
    linear = PackedLinear(native_ops())
    compute_on(threads, native=True)
    out.put(torch.equal(linear(rows, linear.pack(weight)), expected))


def test_a_process_forked_after_the_team_started_computes_without_it(ops, threads_restored: None) -> None:  # type: ignore[no-untyped-def]
    """A child made by fork has none of its parent's helper threads: its calls run on the threads it has."""
    compute_on(2, native=True)
    linear = PackedLinear(ops)
    weight, rows = torch.randn(300, 256), torch.randn(40, 256)
    expected = linear(rows, linear.pack(weight))  # the parent's helpers are started by now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_linear_in_child, args=(2, weight, rows, expected, queue))
    child.start()
    try:
        same = queue.get(timeout=60)
    finally:
        child.join(30)
    assert child.exitcode == 0 and same


def test_one_thread_sets_both_counts_and_gives_them_back(ops, threads_restored: None) -> None:  # type: ignore[no-untyped-def]
    compute_on(3, native=True)
    with one_thread():
        assert (torch.get_num_threads(), ops.get_num_threads()) == (1, 1)
    assert (torch.get_num_threads(), ops.get_num_threads()) == (1, 3)
    compute_on(2, native=False)  # a model on torch's ops: torch's own threads
    assert torch.get_num_threads() == 2


def test_a_thread_count_below_one_is_refused(ops) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="num_threads must be at least 1"):
        compute_on(0, native=True)


def _cgroup(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_a_cgroup_v2_quota_is_the_least_along_the_path(tmp_path: Path) -> None:
    root = _cgroup(
        tmp_path,
        {
            "cpu.max": "max 100000\n",
            "pods/cpu.max": "300000 100000\n",
            "pods/one/cpu.max": "150000 100000\n",
            "pods/one/two/cpu.max": "max 100000\n",
        },
    )
    assert cgroup_cpu_quota(root, "0::/pods/one/two\n") == 1.5
    assert cgroup_cpu_quota(root, "0::/pods\n") == 3.0
    assert cgroup_cpu_quota(root, "0::/\n") is None  # "max": no quota


def test_a_cgroup_v1_quota_is_read_from_the_cpu_controller(tmp_path: Path) -> None:
    root = _cgroup(
        tmp_path, {"cpu,cpuacct/job/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n"}
    )
    assert cgroup_cpu_quota(root, "12:memory:/job\n4:cpu,cpuacct:/job\n") == 0.5
    unlimited = _cgroup(tmp_path / "other", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"})
    assert cgroup_cpu_quota(unlimited, "3:cpu:/\n") is None


def test_usable_cpus_are_at_least_one_and_at_most_the_affinity_mask() -> None:
    import os

    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))
