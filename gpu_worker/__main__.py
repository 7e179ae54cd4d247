"""Entry point: `python -m gpu_worker --model PATH [...]`."""

from __future__ import annotations

import os

# Before torch loads libgomp: keep the OpenMP threads spinning ~ms between parallel regions,
# so the short gap between two decode steps does not put them to sleep (measured here:
# ~15% more tokens/s at batch 1). Idle longer than that, they sleep as usual.
os.environ.setdefault("GOMP_SPINCOUNT", "3000000")

import argparse  # noqa: E402
import sys  # noqa: E402

from common import logs  # noqa: E402
from gpu_worker.config import add_arguments, from_arguments  # noqa: E402
from gpu_worker.worker import Worker  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_worker", description="a specserve target worker process")
    add_arguments(parser)
    parser.add_argument("--log-json", action="store_true")
    args = parser.parse_args(argv)
    logs.configure("gpu_worker", json_logs=args.log_json or None)
    try:
        config = from_arguments(args)
    except ValueError as exc:
        parser.error(str(exc))
    return Worker(config).run()


if __name__ == "__main__":
    sys.exit(main())
