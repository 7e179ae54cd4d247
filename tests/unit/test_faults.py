"""The fault-injection setting: parsed strictly, applied only to the named process and at the named point."""

from __future__ import annotations

import pytest

from common.faults import ENV_VAR, Fault, FaultInjector, InjectedFault, parse_faults
from proto.lifecycle import State


def test_entries_for_phases_and_steps_are_parsed() -> None:
    assert parse_faults("worker-0:LOADING:raise; draft-0:step=5:slow=2.5;;worker-1:step=20:exit") == [
        Fault("worker-0", "LOADING", None, "raise"),
        Fault("draft-0", None, 5, "slow", 2.5),
        Fault("worker-1", None, 20, "exit"),
    ]
    assert parse_faults("") == []
    assert parse_faults("worker-0:WARMING:hang")[0].phase is State.WARMING  # the lifecycle's own phase names


@pytest.mark.parametrize(
    "bad",
    [
        "worker-0:LOADING",
        "worker-0:READY:raise",
        "worker-0:step=0:raise",
        "worker-0:step=2:explode",
        "worker-0:LOADING:slow",
        "worker-0:LOADING:raise=1",
    ],
)
def test_a_bad_entry_is_refused_naming_the_setting(bad: str) -> None:
    with pytest.raises(ValueError, match=ENV_VAR):
        parse_faults(bad)


def test_only_the_named_process_at_the_named_point_is_hit() -> None:
    injector = FaultInjector(
        "worker-1", {ENV_VAR: "worker-0:LOADING:raise;worker-1:WARMING:raise;worker-1:step=3:raise"}
    )
    injector.at_phase("LOADING")  # worker-0's fault
    injector.at_step(2)
    with pytest.raises(InjectedFault, match="in WARMING"):
        injector.at_phase("WARMING")
    with pytest.raises(InjectedFault, match="at step 3"):
        injector.at_step(3)
    assert FaultInjector("worker-2", {}).faults == []
