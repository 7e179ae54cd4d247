"""Structured logging for every process: one event name plus key-values, JSON or console."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(service: str, *, json_logs: bool | None = None, level: str | None = None) -> None:
    """Set up structlog for this process; every line carries `service` and the pid.

    json_logs defaults to the SPECSERVE_LOG_JSON environment variable ("1" = JSON), the
    level to SPECSERVE_LOG_LEVEL (default "info"). Logs go to stderr.
    """
    if json_logs is None:
        json_logs = os.environ.get("SPECSERVE_LOG_JSON", "0") == "1"
    level_name = (level or os.environ.get("SPECSERVE_LOG_LEVEL", "info")).upper()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json_logs else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level_name]),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service, pid=os.getpid())


def get_logger(**context: object) -> structlog.typing.FilteringBoundLogger:
    """A lazy logger: safe at module level, it takes the configuration in force when it first logs."""
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(**context)
    return logger
