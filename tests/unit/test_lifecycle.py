"""The lifecycle transition table: every legal move works and reports its duration, every illegal one raises."""

from __future__ import annotations

import itertools
import time
from collections import deque

import pytest

from proto.lifecycle import INIT_PHASES, TERMINAL, TRANSITIONS, IllegalTransition, Lifecycle, State

LEGAL = [(old, new) for old, targets in TRANSITIONS.items() for new in sorted(targets)]
ILLEGAL = [(old, new) for old, new in itertools.product(State, State) if new not in TRANSITIONS[old]]


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(time, "monotonic", fake)
    return fake


def path_to(target: State) -> list[State]:
    """The shortest chain of legal moves from STARTING to target (breadth first over TRANSITIONS)."""
    previous: dict[State, State | None] = {State.STARTING: None}
    queue = deque([State.STARTING])
    while queue:
        state = queue.popleft()
        for nxt in sorted(TRANSITIONS[state]):
            if nxt not in previous:
                previous[nxt] = state
                queue.append(nxt)
    if target not in previous:
        raise LookupError(f"{target} is unreachable from STARTING")
    chain = [target]
    while (before := previous[chain[-1]]) is not None:
        chain.append(before)
    return chain[::-1][1:]


def lifecycle_in(state: State) -> tuple[Lifecycle, list[tuple[State, State, float]]]:
    moves: list[tuple[State, State, float]] = []
    lifecycle = Lifecycle(lambda old, new, duration_s: moves.append((old, new, duration_s)))
    for step in path_to(state):
        lifecycle.move_to(step)
    moves.clear()
    return lifecycle, moves


def test_the_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(State)
    for targets in TRANSITIONS.values():
        assert targets <= set(State)


def test_a_new_lifecycle_starts_in_starting() -> None:
    assert Lifecycle(lambda *_: None).state is State.STARTING


def test_the_happy_path_reports_every_phase_with_its_duration(clock: FakeClock) -> None:
    moves: list[tuple[State, State, float]] = []
    lifecycle = Lifecycle(lambda old, new, duration_s: moves.append((old, new, duration_s)))
    durations = {
        State.STARTING: 0.5,
        State.LOADING: 7.0,
        State.ALLOCATING: 1.25,
        State.WARMING: 3.0,
        State.READY: 60.0,
        State.DRAINING: 2.0,
    }
    for new in (State.LOADING, State.ALLOCATING, State.WARMING, State.READY, State.DRAINING, State.STOPPED):
        clock.now_s += durations[lifecycle.state]
        lifecycle.move_to(new)
        assert lifecycle.state is new
    assert moves == [
        (State.STARTING, State.LOADING, 0.5),
        (State.LOADING, State.ALLOCATING, 7.0),
        (State.ALLOCATING, State.WARMING, 1.25),
        (State.WARMING, State.READY, 3.0),
        (State.READY, State.DRAINING, 60.0),
        (State.DRAINING, State.STOPPED, 2.0),
    ]


@pytest.mark.parametrize(("old", "new"), LEGAL, ids=[f"{o}->{n}" for o, n in LEGAL])
def test_every_legal_move_works_and_reports_its_duration(old: State, new: State, clock: FakeClock) -> None:
    lifecycle, moves = lifecycle_in(old)
    clock.now_s += 2.5
    lifecycle.move_to(new)
    assert lifecycle.state is new
    assert moves == [(old, new, 2.5)]


REACHABLE_ILLEGAL = [(o, n) for o, n in ILLEGAL if o is not State.DEAD]


@pytest.mark.parametrize(("old", "new"), REACHABLE_ILLEGAL, ids=[f"{o}->{n}" for o, n in REACHABLE_ILLEGAL])
def test_every_illegal_move_raises_and_changes_nothing(old: State, new: State) -> None:
    lifecycle, moves = lifecycle_in(old)
    with pytest.raises(IllegalTransition, match=f"{old} -> {new}"):
        lifecycle.move_to(new)
    assert lifecycle.state is old
    assert moves == []


@pytest.mark.parametrize("state", sorted(TERMINAL))
def test_terminal_states_have_no_exits(state: State) -> None:
    assert TRANSITIONS[state] == frozenset()


@pytest.mark.parametrize("state", sorted(TERMINAL - {State.DEAD}))
def test_a_process_in_a_terminal_state_cannot_move_anywhere(state: State) -> None:
    lifecycle, _ = lifecycle_in(state)
    for new in State:
        with pytest.raises(IllegalTransition):
            lifecycle.move_to(new)
    assert lifecycle.state is state


def test_dead_is_never_entered_by_a_process_itself() -> None:
    assert all(State.DEAD not in targets for targets in TRANSITIONS.values())
    with pytest.raises(IllegalTransition):
        Lifecycle(lambda *_: None).move_to(State.DEAD)


@pytest.mark.parametrize("state", [s for s in State if s not in TERMINAL])
def test_failed_and_stopped_are_reachable_from_every_live_state(state: State) -> None:
    assert {State.FAILED, State.STOPPED} <= TRANSITIONS[state]


def test_init_phases_are_the_chain_that_leads_to_ready() -> None:
    assert INIT_PHASES[0] is State.STARTING
    for before, after in itertools.pairwise((*INIT_PHASES, State.READY)):
        assert after in TRANSITIONS[before]
    # no shortcut: READY is reachable only from the last init phase
    assert [s for s, targets in TRANSITIONS.items() if State.READY in targets] == [INIT_PHASES[-1]]


def test_ready_is_never_re_entered_after_serving() -> None:
    for state in (State.READY, State.DRAINING, *TERMINAL):
        assert not {State.READY, *INIT_PHASES} & TRANSITIONS[state]
