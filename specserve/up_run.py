"""`specserve up`'s run: a resolved UpConfig's stack under the supervisor, the ready line once it serves, then
restarts until a signal.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from specserve.health_probes import stack_serving
from specserve.stack import StackAddresses, StackConfig, service_specs, with_keys
from specserve.supervisor import GaveUp, RestartPolicy, Supervisor
from specserve.up import UpConfig


def ready_line(config: UpConfig) -> str:
    stack = config.stack
    return (
        f"specserve ready: gRPC on {stack.host}:{stack.grpc_port}, HTTP on {stack.host}:{stack.http_port}, "
        f"model {stack.model.name} ({stack.dtype}"
        f"{', weights ' + stack.quantization if stack.quantization != 'none' else ''}, "
        f"{stack.num_workers} worker(s) on {stack.device}), "
        f"draft {config.draft_name}"
        f"{', services unauthenticated on loopback (--insecure-loopback)' if stack.insecure_loopback else ''}"
    )


def run_up(config: UpConfig) -> int:
    """The stack under the supervisor: the ready line once it serves, then restarts until a signal. The exit status.

    Without a key folder given (or --insecure-loopback), this run's keys are made in a private temporary folder,
    removed when it ends."""
    with tempfile.TemporaryDirectory(prefix="specserve-keys-") as folder:
        return _supervise(config, with_keys(config.stack, Path(folder) / "keys"))


def _supervise(config: UpConfig, stack: StackConfig) -> int:
    addresses = StackAddresses.pick(stack)
    supervisor = Supervisor(service_specs(stack, addresses), RestartPolicy())
    supervisor.install_signal_handlers()
    supervisor.start()
    ready_by = time.monotonic() + config.ready_timeout_s

    def serving() -> bool:
        return stack_serving(stack, addresses)

    try:
        supervisor.watch(until=lambda: serving() or time.monotonic() > ready_by)
        if not supervisor.stopping and time.monotonic() > ready_by and not serving():
            print(
                f"specserve up: not serving within {config.ready_timeout_s:g} s (--ready-timeout-s): no target worker "
                "became READY; see the services' logs; stopping",
                file=sys.stderr,
            )
            supervisor.stop(grace_s=10.0)
            return 1
        if not supervisor.stopping:
            print(ready_line(config), flush=True)
            supervisor.watch()
    except GaveUp as exc:
        print(f"specserve up: {exc}; stopping", file=sys.stderr)
        supervisor.stop(grace_s=10.0)
        return 1
    supervisor.stop(grace_s=30.0)
    return 0
