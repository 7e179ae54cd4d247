"""Entry point: `python -m gateway --model PATH --scheduler-address tcp://HOST:PORT --port 50051`."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import uvloop

from common.logs import configure, get_logger
from common.memory import return_freed_memory
from gateway.app import Gateway
from gateway.config import parse_config
from gateway.errors import StartupError


def main(argv: Sequence[str] | None = None) -> int:
    """Run the gateway until it is stopped; 0 after a clean stop, 1 when start-up or serving failed."""
    config = parse_config(argv)
    configure("gateway", json_logs=True if config.log_json else None)
    log = get_logger(gateway_id=config.gateway_id)
    if not return_freed_memory():
        log.info("gateway.allocator_unchanged", note="not glibc: large freed blocks may stay with the process")
    try:
        uvloop.run(Gateway(config).run())
    except StartupError as error:
        log.error("gateway.startup_failed", error=str(error))
        return 1
    except Exception as error:  # fatal: log it with its cause and exit non-zero
        log.exception("gateway.fatal", error_type=type(error).__name__)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
