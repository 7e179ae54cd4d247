"""Real stacks shared by the end-to-end tests; after every test each stack must be idle with its KV empty."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from specserve.stack import StackConfig
from tests.e2e.stack import Stack, running_stack


@pytest.fixture(scope="session")
def fp32_stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """Two float32 data-parallel workers, a thread each."""
    with running_stack(
        StackConfig(default_model_dir, dtype="float32", num_workers=2, max_num_seqs=8, num_threads_per_worker=1),
        tmp_path_factory.mktemp("fp32_stack"),
    ) as stack:
        yield stack


@pytest.fixture(scope="session")
def bf16_stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(
        StackConfig(default_model_dir, dtype="bfloat16", num_workers=1, max_num_seqs=16),
        tmp_path_factory.mktemp("bf16_stack"),
    ) as stack:
        yield stack


@pytest.fixture(autouse=True)
def _stacks_idle_after_test(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    for name in ("fp32_stack", "bf16_stack"):
        if name in request.fixturenames:
            stack: Stack = request.getfixturevalue(name)
            stack.wait_idle()


@pytest.fixture(scope="session")
def no_worker_stack(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A scheduler and a gateway but no worker: a queue of 2 and a 3 s wait for a READY worker."""
    config = StackConfig(
        default_model_dir, num_workers=0, scheduler_args=("--max-queue-len", "2", "--no-worker-timeout-s", "3")
    )
    yield from workerless_stack(config, tmp_path_factory.mktemp("no_worker_stack"))


def workerless_stack(config: StackConfig, log_dir: Path) -> Iterator[Stack]:
    """A stack that starts without waiting to serve (it has no worker yet): reachable, not SERVING."""
    stack = Stack(config, log_dir)
    try:
        stack.start(wait_serving=False)
        stack.wait_reachable()
        yield stack
    finally:
        stack.stop()
