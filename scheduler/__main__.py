"""Entry point: `python -m scheduler [...]`."""

from __future__ import annotations

import argparse
import sys

import uvloop

from common import logs
from scheduler.config import add_arguments, from_arguments
from scheduler.service import SchedulerService


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scheduler", description="the specserve scheduler process")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logs.configure("scheduler", json_logs=args.log_json or None)
    try:
        config = from_arguments(args)
    except ValueError as exc:
        parser.error(str(exc))
    uvloop.run(SchedulerService(config).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
