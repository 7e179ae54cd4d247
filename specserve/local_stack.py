"""LocalStack: a stack's processes started unsupervised, for the end-to-end tests and the benchmarks.

Each process writes to a log file of its own and, once it exits, stays down; a fault is
injected into one when asked. `running` starts one and stops it on the way out.
`specserve up` runs the same command lines (stack.py) under its supervisor instead.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from common.draft_spec import DraftSpec
from common.faults import ENV_VAR as FAULT_ENV_VAR
from specserve.health_probes import stack_serving
from specserve.stack import StackAddresses, StackConfig, draft_spec, service_specs, with_keys, worker_spec
from specserve.supervisor import ServiceSpec

_POLL_S = 0.2
_LOG_TAIL_CHARS = 4000


class StackError(RuntimeError):
    """The stack did not serve: a process exited first, or time ran out. The message ends with the processes' logs."""


class LocalStack:
    """A stack's processes, unsupervised (one that exits stays down), each writing to LOG_DIR/NAME.log.

    `processes` holds the processes started, by name (scheduler, worker-N, draft, gateway);
    a test may signal one, or start another worker or draft service next to them.
    """

    def __init__(self, config: StackConfig, log_dir: Path) -> None:
        self.config = with_keys(config, log_dir / "keys")
        self.log_dir = log_dir
        self.addresses = StackAddresses.pick(self.config)
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, wait_serving: bool = True, timeout_s: float = 240.0) -> None:
        for spec in service_specs(self.config, self.addresses):
            self.spawn(spec)
        if wait_serving:
            self.wait_serving(timeout_s)

    def start_worker(
        self,
        index: int | str,
        extra_args: tuple[str, ...] = (),
        fault: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """Start worker `index` (its id is worker-INDEX); `fault` sets SPECSERVE_FAULT for it alone, `env` more."""
        self.spawn(worker_spec(self.config, self.addresses, index, extra_args), fault=fault, env=env)

    def start_draft(self, draft: DraftSpec, fault: str | None = None) -> None:
        """Start a draft service proposing with `draft` (the one running, if any, should be stopped first)."""
        self.spawn(draft_spec(self.config, self.addresses, draft), fault=fault)

    def spawn(self, spec: ServiceSpec, fault: str | None = None, env: dict[str, str] | None = None) -> None:
        with (self.log_dir / f"{spec.name}.log").open("ab") as log:
            changes = {**(env or {}), **({FAULT_ENV_VAR: fault} if fault else {})}
            environ = {**os.environ, **changes} if changes else None
            self.processes[spec.name] = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT, env=environ)

    def wait_serving(self, timeout_s: float) -> None:
        """Until the gateway is SERVING; StackError if a process exits first or `timeout_s` passes."""
        deadline_s = time.monotonic() + timeout_s
        while not stack_serving(self.config, self.addresses):
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise StackError(f"{name} exited with {process.returncode}\n{self.logs()}")
            if time.monotonic() > deadline_s:
                raise StackError(f"the stack did not become SERVING in {timeout_s:g} s\n{self.logs()}")
            time.sleep(_POLL_S)

    def stop(self) -> None:
        """SIGTERM the gateway first (it drains its streams), then the rest; SIGKILL what is still up after 20 s."""
        for name in sorted(self.processes, key=lambda n: n != "gateway"):
            if self.processes[name].poll() is None:
                self.processes[name].terminate()
        for process in self.processes.values():
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def logs(self) -> str:
        """The end of every process's log."""
        return "\n".join(
            f"===== {p.name}\n{p.read_text(errors='replace')[-_LOG_TAIL_CHARS:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )


S = TypeVar("S", bound=LocalStack)


@contextmanager
def running(stack: S, timeout_s: float = 240.0) -> Iterator[S]:
    """`stack` started and serving, stopped on the way out whatever happened."""
    try:
        stack.start(timeout_s=timeout_s)
        yield stack
    finally:
        stack.stop()
