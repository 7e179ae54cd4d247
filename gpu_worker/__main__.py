"""Entry point: `python -m gpu_worker --model PATH [...]`."""

from __future__ import annotations

import os

# Before torch loads libgomp: keep the OpenMP threads spinning ~ms between parallel regions,
# so the short gap between two decode steps does not put them to sleep (measured here:
# ~15% more tokens/s at batch 1). Idle longer than that, they sleep as usual. They compute a
# model only where the native kernels do not serve it (torch ops alone); the kernels have a
# thread team of their own, and torch's ops then run on one thread (modeling/kernels/threads.py).
os.environ.setdefault("GOMP_SPINCOUNT", "3000000")

import sys  # noqa: E402

from common.lifecycle_process import process_main  # noqa: E402
from gpu_worker.config import add_arguments, from_arguments  # noqa: E402
from gpu_worker.worker import Worker  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return process_main(
        argv,
        prog="gpu_worker",
        description="a specserve target worker process",
        add_arguments=add_arguments,
        build=lambda args: Worker(from_arguments(args)),
    )


if __name__ == "__main__":
    sys.exit(main())
