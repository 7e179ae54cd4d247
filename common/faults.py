"""Fault injection for tests, through one setting: the SPECSERVE_FAULT environment variable.

    SPECSERVE_FAULT="<process_id>:<when>:<action>[;...]"

- `process_id`: the worker or draft id it applies to (`worker-1`, `draft-0`); other
  processes ignore the entry, so one value can be given to a whole stack.
- `when`: a start-up phase (`STARTING`, `LOADING`, `ALLOCATING`, `WARMING`), at its start,
  or `step=N`, at the N-th step a target worker runs (the N-th proposal for the draft
  service), counted from 1.
- `action`: `raise` (an exception: the process reports FAILED and exits 1), `exit` (dies
  at once with status 3, reporting nothing, like a crash or a kill), `hang` (the main
  thread stops for good; heartbeats go on from their own thread, so only the phase and
  step deadlines catch it), or `slow=SECONDS` (sleeps that long, then goes on).

Examples: `worker-0:LOADING:raise`, `worker-1:step=20:exit`, `draft-0:step=5:slow=2.5`.
Nothing here runs unless the variable is set.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass

from proto.lifecycle import INIT_PHASES, State

ENV_VAR = "SPECSERVE_FAULT"
ACTIONS = ("raise", "exit", "hang", "slow")
EXIT_STATUS = 3


class InjectedFault(RuntimeError):
    """Raised by a `raise` fault."""


@dataclass(frozen=True)
class Fault:
    process_id: str
    phase: State | None  # one of INIT_PHASES, or None for a step fault
    step: int | None  # 1-based step number, or None for a phase fault
    action: str
    seconds: float = 0.0  # for slow


def parse_faults(text: str) -> list[Fault]:
    """Raises ValueError naming the setting and the bad entry."""
    faults = []
    for entry in filter(None, (part.strip() for part in text.split(";"))):
        parts = entry.split(":")
        if len(parts) != 3:
            raise ValueError(f"{ENV_VAR}: {entry!r} is not <process_id>:<when>:<action>")
        process_id, when, action_text = parts
        action, _, argument = action_text.partition("=")
        if action not in ACTIONS or (action == "slow") != bool(argument):
            raise ValueError(f"{ENV_VAR}: {entry!r}: the action must be raise, exit, hang or slow=SECONDS")
        seconds = float(argument) if argument else 0.0
        if when.startswith("step="):
            step = int(when.removeprefix("step="))
            if step < 1:
                raise ValueError(f"{ENV_VAR}: {entry!r}: steps count from 1")
            faults.append(Fault(process_id, None, step, action, seconds))
        elif when in INIT_PHASES:
            faults.append(Fault(process_id, State(when), None, action, seconds))
        else:
            raise ValueError(f"{ENV_VAR}: {entry!r}: when must be one of {', '.join(INIT_PHASES)} or step=N")
    return faults


class FaultInjector:
    """The faults meant for one process; `at_phase` and `at_step` do what they say when one matches."""

    def __init__(self, process_id: str, environ: Mapping[str, str] = os.environ) -> None:
        self.faults = [f for f in parse_faults(environ.get(ENV_VAR, "")) if f.process_id == process_id]

    def at_phase(self, phase: State) -> None:
        for fault in self.faults:
            if fault.phase == phase:
                _act(fault, f"in {phase}")

    def at_step(self, step: int) -> None:
        for fault in self.faults:
            if fault.step == step:
                _act(fault, f"at step {step}")


def _act(fault: Fault, where: str) -> None:
    match fault.action:
        case "raise":
            raise InjectedFault(f"injected fault {where} ({ENV_VAR})")
        case "exit":
            os._exit(EXIT_STATUS)
        case "hang":
            while True:
                time.sleep(3600)
        case "slow":
            time.sleep(fault.seconds)
