"""The local supervisor on real child processes: restart with backoff, give up past the limit, stop in order."""

from __future__ import annotations

import os
import sys
import time

import pytest

from specserve.supervisor import GaveUp, RestartPolicy, ServiceSpec, Supervisor

CRASH = [sys.executable, "-c", "import sys; sys.exit(3)"]
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]
FAST = RestartPolicy(initial_backoff_s=0.05, max_backoff_s=0.2, max_restarts=3, window_s=60)


def test_a_crashing_service_is_restarted_with_backoff_then_given_up() -> None:
    supervisor = Supervisor([ServiceSpec("crasher", CRASH, 0), ServiceSpec("sleeper", SLEEP, 1)], FAST)
    supervisor.start()
    first_pid = supervisor.pids()["crasher"]
    started = time.monotonic()
    try:
        with pytest.raises(GaveUp, match="crasher exited 4 times"):
            supervisor.watch(poll_s=0.02)
        # The first exit restarted at once, then backoffs of 0.05 and 0.1 s before giving up.
        assert time.monotonic() - started >= 0.15
        assert supervisor.pids()["crasher"] != first_pid
    finally:
        supervisor.stop(grace_s=5)


def test_a_crashing_optional_service_stays_down_and_the_rest_go_on() -> None:
    supervisor = Supervisor([ServiceSpec("draft", CRASH, 1, essential=False), ServiceSpec("sleeper", SLEEP, 0)], FAST)
    supervisor.start()
    sleeper = supervisor.pids()["sleeper"]
    try:
        deadline = time.monotonic() + 3.0
        supervisor.watch(until=lambda: time.monotonic() > deadline, poll_s=0.02)  # no GaveUp
        last_draft = supervisor.pids()["draft"]
        time.sleep(0.5)
        supervisor.watch(until=lambda: True)
        assert supervisor.pids() == {"draft": last_draft, "sleeper": sleeper}  # no more restarts
        os.kill(sleeper, 0)
    finally:
        supervisor.stop(grace_s=5)


def test_stop_terminates_every_child() -> None:
    supervisor = Supervisor([ServiceSpec("a", SLEEP, 0), ServiceSpec("b", SLEEP, 1)], FAST)
    supervisor.start()
    pids = supervisor.pids()
    supervisor.watch(until=lambda: True)
    supervisor.stop(grace_s=5)
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
