"""Fault injection for tests, through one setting: the SPECSERVE_FAULT environment variable.

    SPECSERVE_FAULT="<process_id>:<when>:<action>[;...]"

- `process_id`: the worker or draft id it applies to (`worker-1`, `draft-0`); other
  processes ignore the entry, so one value can be given to a whole stack.
- `when`: a start-up phase (`STARTING`, `LOADING`, `ALLOCATING`, `WARMING`), at its start;
  `step=N`, at the N-th step a target worker runs (the N-th proposal for the draft
  service); or `capture=N`, before a target worker captures its N-th graph, within WARMING
  (modeling/model/graphs.py). N counts from 1.
- `action`: `raise` (an exception: the process reports FAILED and exits 1), `exit` (dies
  at once with status 3, reporting nothing, like a crash or a kill), `hang` (the main
  thread stops for good; heartbeats go on from their own thread, so only the phase and
  step deadlines catch it), or `slow=SECONDS` (sleeps that long, then goes on).

Examples: `worker-0:LOADING:raise`, `worker-1:step=20:exit`, `draft-0:step=5:slow=2.5`,
`worker-0:capture=3:hang`.
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
    phase: State | None  # one of INIT_PHASES, or None for a step or capture fault
    step: int | None  # 1-based step number, or None for a phase or capture fault
    action: str
    seconds: float = 0.0  # for slow
    capture: int | None = None  # 1-based graph number, for a capture fault


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
        if when.startswith(("step=", "capture=")):
            kind, _, number_text = when.partition("=")
            number = int(number_text)
            if number < 1:
                raise ValueError(f"{ENV_VAR}: {entry!r}: {kind}s count from 1")
            if kind == "step":
                faults.append(Fault(process_id, None, number, action, seconds))
            else:
                faults.append(Fault(process_id, None, None, action, seconds, capture=number))
        elif when in INIT_PHASES:
            faults.append(Fault(process_id, State(when), None, action, seconds))
        else:
            raise ValueError(f"{ENV_VAR}: {entry!r}: when must be one of {', '.join(INIT_PHASES)}, step=N or capture=N")
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

    def at_capture(self, number: int) -> None:
        for fault in self.faults:
            if fault.capture == number:
                _act(fault, f"capturing graph {number}")


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
