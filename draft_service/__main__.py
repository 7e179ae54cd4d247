"""Entry point: `python -m draft_service --proposer ngram|model:PATH [...]`."""

from __future__ import annotations

import os

# As in the target worker: keep OpenMP threads spinning between the draft model's short forwards (on torch ops).
os.environ.setdefault("GOMP_SPINCOUNT", "3000000")

import sys  # noqa: E402

from common.lifecycle_process import process_main  # noqa: E402
from draft_service.config import add_arguments, from_arguments  # noqa: E402
from draft_service.service import DraftService  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return process_main(
        argv,
        prog="draft_service",
        description="the specserve draft service: proposes speculative tokens",
        add_arguments=add_arguments,
        build=lambda args: DraftService(from_arguments(args)),
    )


if __name__ == "__main__":
    sys.exit(main())
