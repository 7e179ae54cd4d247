"""The scheduler's view of every worker process: identity, incarnation, lifecycle state, slots, placed requests."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from proto.lifecycle import State
from proto.messages import ProcessInfo, WorkerHello
from scheduler.request import Request


@dataclass(frozen=True)
class StepSeq:
    request: Request
    num_tokens: int  # tokens of the sequence itself the step computes (draft tokens not counted)
    samples: bool
    draft_token_ids: list[int]  # the proposal it verifies; empty without one
    draft_generation: int = 0  # the request's DraftView generation when the proposal was made
    draft_parents: list[int] | None = None  # the proposal's token tree (modeling.trees); None: a chain


@dataclass
class InFlightStep:
    step_id: int
    sent_at_s: float
    seqs: list[StepSeq]  # in step order


@dataclass
class WorkerRecord:
    hello: WorkerHello
    identity: bytes  # ZeroMQ routing identity of its main socket
    state: State
    last_seen_s: float
    state_since_s: float  # when it entered `state` (as the scheduler saw it)
    free_slots: list[int]  # a heap: the lowest free slot is used first, keeping slots dense
    requests: dict[str, Request] = field(default_factory=dict)  # placed here, in placement order
    in_flight: InFlightStep | None = None
    awaiting_proposal: int | None = None  # the propose_id its next step waits for
    told_to_stop: bool = False  # a Drain was sent to this incarnation
    num_used_kv_slots: int = 0  # as the worker last reported
    # A target's longest proposal per step: its hello's, lowered by its READY report (0: it
    # serves without speculation, its steps not being batch invariant).
    max_draft_tokens: int = 0
    failure: str = ""

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    @property
    def incarnation(self) -> int:
        return self.hello.incarnation

    @property
    def is_ready(self) -> bool:
        return self.state is State.READY

    @property
    def runs_steps(self) -> bool:
        """READY, or DRAINING: the requests already placed here run to their end; nothing new is placed."""
        return self.state in (State.READY, State.DRAINING)

    @property
    def is_target(self) -> bool:
        return self.hello.role == "target"

    @property
    def is_busy(self) -> bool:
        return self.in_flight is not None or self.awaiting_proposal is not None

    def take_slot(self) -> int:
        return heapq.heappop(self.free_slots)

    def give_back_slot(self, slot: int) -> None:
        heapq.heappush(self.free_slots, slot)

    def info(self, now_s: float) -> ProcessInfo:
        return ProcessInfo(
            process_id=self.worker_id,
            role=self.hello.role,
            state=self.state,
            incarnation=self.incarnation,
            heartbeat_age_s=round(now_s - self.last_seen_s, 3),
            num_used_kv_slots=self.num_used_kv_slots,
            num_kv_slots=self.hello.num_kv_slots,
            num_running=len(self.requests),
            failure=self.failure,
        )


def new_record(hello: WorkerHello, identity: bytes, now_s: float) -> WorkerRecord:
    return WorkerRecord(
        hello=hello, identity=identity, state=State.STARTING, last_seen_s=now_s, state_since_s=now_s,
        free_slots=list(range(hello.num_kv_slots)) if hello.role == "target" else [],  # the draft holds no request
        max_draft_tokens=hello.max_draft_tokens,
    )


def least_loaded_ready(workers: list[WorkerRecord]) -> WorkerRecord | None:
    """The READY target worker with a free slot and the fewest placed requests (ties: registration order)."""
    candidates = [w for w in workers if w.is_target and w.is_ready and w.free_slots]
    return min(candidates, key=lambda w: len(w.requests), default=None)
