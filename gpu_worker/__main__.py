"""Entry point: `python -m gpu_worker --model PATH [...]`."""

from __future__ import annotations

import argparse
import sys

from common import logs
from gpu_worker.config import add_arguments, from_arguments
from gpu_worker.worker import Worker


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
