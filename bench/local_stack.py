"""A stack for a benchmark, started from `specserve up` flags by the one launcher (specserve/local_stack.py),
with up's defaults."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specserve.local_stack import LocalStack, StackError, running
from specserve.up import UpRefused, add_up_arguments, up_config
from specserve.up_run import ready_line


@dataclass(frozen=True)
class ReadyStack:
    address: str  # HOST:PORT of the gateway's gRPC API
    http_address: str  # HOST:PORT of its OpenAI HTTP API
    ready_line: str  # what `specserve up` prints once it serves
    dtype: str
    device: str
    log_dir: Path  # a log file per process


@contextmanager
def running_up(up_flags: Sequence[str]) -> Iterator[ReadyStack]:
    """The stack `specserve up UP_FLAGS` runs, yielded once it serves and always stopped on the way out.

    Unsupervised: a process that exits stays down. Raises StackError when up refuses the
    flags, a process exits before the stack serves, or --ready-timeout-s runs out.
    """
    parser = argparse.ArgumentParser(prog="specserve up")
    add_up_arguments(parser)
    try:
        config = up_config(parser.parse_args(list(up_flags)))
    except UpRefused as refusal:
        raise StackError(f"specserve up: {refusal}") from refusal
    log_dir = Path(tempfile.mkdtemp(prefix="specserve-bench-"))
    with running(LocalStack(config.stack, log_dir), timeout_s=config.ready_timeout_s) as stack:
        yield ReadyStack(
            address=f"127.0.0.1:{stack.addresses.grpc_port}",
            http_address=f"127.0.0.1:{stack.addresses.http_port}",
            ready_line=ready_line(config),
            dtype=config.stack.dtype,
            device=config.stack.device,
            log_dir=log_dir,
        )
