"""The scheduler's view of every worker process (targets and the draft service) and the moves of their lifecycle.

A process reports its own moves (proto.lifecycle.TRANSITIONS); on top of those the
scheduler may give its verdict on any live process: FAILED (refused, a bad step) or
DEAD (silent, replaced). Every move goes through WorkerRecord.move_to.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from common.page_pool import PagePool
from proto import messages as m
from proto.lifecycle import INIT_PHASES, TERMINAL, TRANSITIONS, IllegalTransition, State
from scheduler.batching import InFlightStep
from scheduler.requests import Request
from scheduler.speculation.cost import StepCostModel
from scheduler.speculation.policy import ExploreBudget

# The moves the scheduler makes on its records: every reported one, and a verdict on any live process.
SCHEDULER_TRANSITIONS: dict[State, frozenset[State]] = {
    state: moves | ({State.FAILED, State.DEAD} if state not in TERMINAL else frozenset())
    for state, moves in TRANSITIONS.items()
}


@dataclass
class WorkerRecord:
    hello: m.WorkerHello
    identity: bytes  # ZeroMQ routing identity of its main socket
    last_seen_s: float
    state_since_s: float  # when it entered `state` (as the scheduler saw it)
    # A target's KV pages, as the scheduler assigns them (None: a draft, or a target that is gone).
    pages: PagePool | None = None
    state: State = State.STARTING  # moved only by move_to
    requests: dict[str, Request] = field(default_factory=dict)  # placed here, in placement order
    in_flight: InFlightStep | None = None
    awaiting_proposal: int | None = None  # the propose_id its next step waits for
    told_to_stop: bool = False  # a Drain was sent to this incarnation
    num_used_kv_pages: int = 0  # as the process last reported (a draft's own cache)
    num_preemptions: int = 0  # sequences preempted here for lack of pages
    protocol_errors: dict[str, int] = field(default_factory=dict)  # messages it dropped, by kind, as last reported
    # A target's longest proposal per step: its hello's, lowered by its READY report (0: it
    # serves without speculation, its steps not being batch invariant).
    max_draft_tokens: int = 0
    kernels: str = ""  # which kernels its model runs on, as its READY report said
    batch_invariant: bool | None = None  # a target's READY report: whether its steps are batch invariant
    graphs: str = ""  # a target's READY report: its captured graphs, or why it serves without them
    cost: StepCostModel = field(default_factory=StepCostModel)  # its step time, fitted to the steps it ran
    explore: ExploreBudget = field(default_factory=ExploreBudget)  # what asks its estimates do not call for may spend
    suspect_turn: bool = False  # the last step planned here ran a suspect request alone (stepping._step_candidates)
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
    def is_live(self) -> bool:
        return self.state not in TERMINAL

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

    def sent_by(self, identity: bytes, message: m.WorkerToScheduler) -> bool:
        """Whether `message` came from this process: its main socket (the one that said the hello), or for heartbeats
        and the watchdog's failure report its heartbeat socket (common/heartbeat_thread.py)."""
        if identity == self.identity:
            return True
        return isinstance(message, m.Heartbeat | m.WorkerFailed) and identity == m.heartbeat_identity(self.identity)

    def move_to(self, state: State, now_s: float) -> None:
        if state not in SCHEDULER_TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.worker_id}: {self.state} -> {state} is not a move the scheduler makes")
        self.state, self.state_since_s = state, now_s

    def place(self, request: Request) -> None:
        """Hold `request` here (its pages are already admitted to `pages`)."""
        self.requests[request.request_id] = request

    def remove(self, request: Request) -> bool:
        """Take a placed request off this worker, freeing its pages; False when it was not placed here."""
        if self.requests.get(request.request_id) is not request:
            return False
        del self.requests[request.request_id]
        if self.pages is not None and request.request_id in self.pages:
            self.pages.release(request.request_id)
        return True

    def lose_pages(self) -> None:
        """The process is gone, and its cache with it."""
        self.requests.clear()
        self.pages = None

    def info(self, now_s: float) -> m.ProcessInfo:
        pages = self.pages
        fitted = [round(value, 4) for value in self.cost.coefficients() or [0.0] * 7]
        return m.ProcessInfo(
            process_id=self.worker_id,
            role=self.hello.role,
            state=self.state,
            incarnation=self.incarnation,
            heartbeat_age_s=round(now_s - self.last_seen_s, 3),
            num_used_kv_pages=self.num_used_kv_pages if pages is None else pages.num_used,
            num_kv_pages=self.hello.num_kv_pages,
            kv_page_size=self.hello.kv_page_size,
            num_running=len(self.requests),
            # What the process said is cut to what a gateway takes (proto/frames.py).
            failure=self.failure[: m.MAX_REASON_CHARS],
            protocol_errors={
                kind[: m.MAX_ERROR_KIND_CHARS]: count
                for kind, count in list(self.protocol_errors.items())[: m.MAX_ERROR_KINDS]
            },
            num_cached_kv_pages=0 if pages is None else pages.num_cached,
            prefix_cache_queried_tokens=0 if pages is None else pages.counters.num_queried_tokens,
            prefix_cache_hit_tokens=0 if pages is None else pages.counters.num_hit_tokens,
            num_preemptions=self.num_preemptions,
            kernels=self.kernels,
            batch_invariant=self.batch_invariant,
            graphs=self.graphs,
            step_predicted_ms=round(self.cost.predicted_ms, 3),
            step_measured_ms=round(self.cost.measured_ms, 3),
            num_costed_steps=self.cost.num_steps,
            step_fixed_ms=fitted[0],
            step_ms_per_row=fitted[1],
            step_ms_per_prefill_token=fitted[5],
            step_ms_per_kilo_context=fitted[6],
            step_cost_error_ms=round(self.cost.abs_error_ms, 3),
            step_ms_per_constrained_row=fitted[4],
            step_ms_per_row_by_range=fitted[1:4] if self.cost.coefficients() is not None else [],
        )


class WorkerRegistry:
    """The current incarnation of each worker id, and what the target replicas said about their model."""

    def __init__(self, max_model_len: int) -> None:
        self._max_model_len = max_model_len
        self._records: dict[str, WorkerRecord] = {}  # in registration order
        self.target_fingerprint: str | None = None
        self.target_vocab: str | None = None  # the targets' vocabulary fingerprint
        self.target_vocab_size = 0
        self.target_feature_width = 0  # the width of the features the targets return

    def __iter__(self) -> Iterator[WorkerRecord]:
        return iter(list(self._records.values()))

    def current(self, worker_id: str, incarnation: int) -> WorkerRecord | None:
        """The live record of that incarnation; None for anything gone or stale."""
        worker = self._records.get(worker_id)
        if worker is None or worker.incarnation != incarnation or not worker.is_live:
            return None
        return worker

    def holding(self, request: Request) -> WorkerRecord | None:
        """The record (of any state) of the worker the request was placed on, if any."""
        return self._records.get(request.worker_id) if request.worker_id is not None else None

    def has_ready_target(self) -> bool:
        return any(w.is_ready and w.is_target for w in self._records.values())

    def ready_draft(self) -> WorkerRecord | None:
        return next((w for w in self._records.values() if w.is_ready and not w.is_target), None)

    def ready_targets(self) -> list[WorkerRecord]:
        """The READY target workers, in registration order."""
        return [w for w in self._records.values() if w.is_target and w.is_ready and w.pages is not None]

    def replaced_by(self, hello: m.WorkerHello) -> tuple[bool, WorkerRecord | None]:
        """(whether the hello is new, the live record it replaces).

        A repeated hello, or a stale one (an older incarnation) while the known one lives,
        is not new. A gone incarnation is replaced by any other: one started after it may
        still read an earlier clock.
        """
        known = self._records.get(hello.worker_id)
        if known is None:
            return True, None
        if known.incarnation == hello.incarnation or (known.incarnation > hello.incarnation and known.is_live):
            return False, None
        return True, known if known.is_live else None

    def register(
        self, hello: m.WorkerHello, identity: bytes, now_s: float, *, prefix_cache: bool = True
    ) -> WorkerRecord:
        # The draft holds no request, and its own pages; a target without pages is refused (incompatibility).
        has_pages = hello.role == "target" and hello.num_kv_pages >= 1 and hello.kv_page_size >= 1
        worker = WorkerRecord(
            hello=hello,
            identity=identity,
            last_seen_s=now_s,
            state_since_s=now_s,
            pages=PagePool(hello.num_kv_pages, hello.kv_page_size, prefix_cache=prefix_cache) if has_pages else None,
            max_draft_tokens=hello.max_draft_tokens,
        )
        self._records[hello.worker_id] = worker
        return worker

    def note_target(self, hello: m.WorkerHello) -> list[WorkerRecord]:
        """A compatible target said hello: remember its model; returns the live drafts that no longer fit."""
        self.target_fingerprint = self.target_fingerprint or hello.model_fingerprint
        self.target_vocab = self.target_vocab or hello.vocab_fingerprint
        self.target_vocab_size = hello.vocab_size
        self.target_feature_width = hello.feature_width
        return [w for w in self._records.values() if not w.is_target and w.is_live and self.draft_problem(w.hello)]

    def incompatibility(self, hello: m.WorkerHello) -> str:
        """Why this process cannot serve with the others ("" when it can)."""
        if hello.protocol_version != m.PROTOCOL_VERSION:
            return f"protocol version {hello.protocol_version}, the scheduler speaks {m.PROTOCOL_VERSION}"
        if hello.role == "target" and (hello.num_kv_pages < 1 or hello.kv_page_size < 1):
            return f"its KV cache has {hello.num_kv_pages} pages of {hello.kv_page_size} positions"
        if hello.max_model_len < self._max_model_len:
            return f"max_model_len {hello.max_model_len} is below the scheduler's {self._max_model_len}"
        if hello.role == "draft":
            return self.draft_problem(hello)
        if self.target_fingerprint not in (None, hello.model_fingerprint):
            return (
                f"model fingerprint {hello.model_fingerprint} "
                f"differs from the other replicas' {self.target_fingerprint}"
            )
        return ""

    def draft_problem(self, hello: m.WorkerHello) -> str:
        """A draft must propose in the targets' vocabulary; one that works on any (n-gram) always fits.

        A draft trained for one target (it names the target's fingerprint) serves only that
        target, and one that reads target features needs them at its width.
        """
        if self.target_vocab and hello.vocab_fingerprint and hello.vocab_fingerprint != self.target_vocab:
            return (
                f"the draft's vocabulary (fingerprint {hello.vocab_fingerprint}, {hello.vocab_size} tokens) differs "
                f"from the target's (fingerprint {self.target_vocab}, {self.target_vocab_size} tokens)"
            )
        if self.target_fingerprint and hello.target_fingerprint and hello.target_fingerprint != self.target_fingerprint:
            return (
                f"the draft was trained for another target model (fingerprint {hello.target_fingerprint}, "
                f"the target's is {self.target_fingerprint})"
            )
        if self.target_feature_width and hello.feature_width and hello.feature_width != self.target_feature_width:
            return (
                f"the draft reads features of width {hello.feature_width}, "
                f"the target's are {self.target_feature_width} wide"
            )
        return ""

    def overdue(
        self, now_s: float, phase_timeout_s: float, heartbeat_timeout_s: float, step_timeout_s: float
    ) -> list[tuple[WorkerRecord, State, str]]:
        """The live processes past a deadline: each with the verdict (FAILED or DEAD) and why."""
        verdicts = []
        for worker in self._records.values():
            if not worker.is_live:
                continue
            if worker.state in INIT_PHASES and now_s - worker.state_since_s > phase_timeout_s:
                verdicts.append(
                    (
                        worker,
                        State.FAILED,
                        f"{worker.state} ran past its {phase_timeout_s:g} s deadline (--phase-timeout-s)",
                    )
                )
            elif now_s - worker.last_seen_s > heartbeat_timeout_s:
                verdicts.append(
                    (
                        worker,
                        State.DEAD,
                        f"no heartbeat for {now_s - worker.last_seen_s:.1f} s "
                        f"(--heartbeat-timeout-s {heartbeat_timeout_s})",
                    )
                )
            elif worker.in_flight and now_s - worker.in_flight.sent_at_s > step_timeout_s:
                verdicts.append(
                    (
                        worker,
                        State.DEAD,
                        f"step {worker.in_flight.step_id} unanswered for {step_timeout_s} s (--step-timeout-s)",
                    )
                )
        return verdicts
