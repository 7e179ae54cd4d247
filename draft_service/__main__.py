"""Entry point: `python -m draft_service --proposer ngram|model:PATH [...]`."""

from __future__ import annotations

import os

# As in the target worker: keep OpenMP threads spinning between the draft model's short forwards.
os.environ.setdefault("GOMP_SPINCOUNT", "3000000")

import argparse  # noqa: E402
import sys  # noqa: E402

from common import logs  # noqa: E402
from draft_service.config import add_arguments, from_arguments  # noqa: E402
from draft_service.service import DraftService  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draft_service", description="the specserve draft service: proposes speculative tokens")
    add_arguments(parser)
    parser.add_argument("--log-json", action="store_true")
    args = parser.parse_args(argv)
    logs.configure("draft_service", json_logs=args.log_json or None)
    try:
        config = from_arguments(args)
    except ValueError as exc:
        parser.error(str(exc))
    return DraftService(config).run()


if __name__ == "__main__":
    sys.exit(main())
