"""The lifecycle of a worker or draft process: its states and the one table of legal moves."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable


class State(enum.StrEnum):
    STARTING = "STARTING"
    LOADING = "LOADING"
    ALLOCATING = "ALLOCATING"
    WARMING = "WARMING"
    READY = "READY"
    DRAINING = "DRAINING"
    STOPPED = "STOPPED"
    FAILED = "FAILED"
    # Never reported by a process about itself: the scheduler's verdict on a silent one.
    DEAD = "DEAD"


# Every state a process may move to from each state. FAILED is reachable from any live state.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.LOADING, State.FAILED, State.STOPPED}),
    State.LOADING: frozenset({State.ALLOCATING, State.FAILED, State.STOPPED}),
    State.ALLOCATING: frozenset({State.WARMING, State.FAILED, State.STOPPED}),
    State.WARMING: frozenset({State.READY, State.FAILED, State.STOPPED}),
    State.READY: frozenset({State.DRAINING, State.FAILED, State.STOPPED}),
    State.DRAINING: frozenset({State.STOPPED, State.FAILED}),
    State.STOPPED: frozenset(),
    State.FAILED: frozenset(),
    State.DEAD: frozenset(),
}

# The start-up phases in order: the state a process is in while doing each one.
INIT_PHASES: tuple[State, ...] = (State.STARTING, State.LOADING, State.ALLOCATING, State.WARMING)
TERMINAL: frozenset[State] = frozenset({State.STOPPED, State.FAILED, State.DEAD})


class IllegalTransition(RuntimeError):
    """A move that the transition table does not allow: a bug in the caller, never input."""


class Lifecycle:
    """One process's current state; every move is checked against TRANSITIONS and reported.

    `on_transition(old, new, duration_s)` is called after each legal move with the time
    spent in the old state, so the owner can log it and tell the scheduler.
    """

    def __init__(self, on_transition: Callable[[State, State, float], None]) -> None:
        self._state = State.STARTING
        self._entered_at = time.monotonic()
        self._on_transition = on_transition

    @property
    def state(self) -> State:
        return self._state

    def move_to(self, new: State) -> None:
        old = self._state
        if new not in TRANSITIONS[old]:
            raise IllegalTransition(f"{old} -> {new} is not a legal lifecycle transition")
        now = time.monotonic()
        duration_s = now - self._entered_at
        self._state, self._entered_at = new, now
        self._on_transition(old, new, duration_s)
