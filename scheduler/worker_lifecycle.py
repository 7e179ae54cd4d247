"""A worker process as the scheduler follows it from its hello: registered, or refused (unbelievable, incompatible,
a duplicate of a live process), then each transition it reports (READY with its kernels and step cost, DRAINING,
FAILED, STOPPED), checked against the lifecycle table."""

from __future__ import annotations

from collections.abc import Callable

from common.logs import get_logger
from common.protocol_errors import ProtocolErrors
from common.step_shape import StepShape
from proto import messages as m
from proto.lifecycle import TRANSITIONS, State
from proto.messages import MAX_STEP_TIMINGS
from scheduler.admission import token_problem
from scheduler.config import SchedulerConfig
from scheduler.endings import Endings
from scheduler.finishing import Finisher
from scheduler.outbox import Outbox
from scheduler.request_table import RequestTable
from scheduler.speculation.link import DraftLink
from scheduler.hellos import MAX_KERNELS_CHARS, hello_problem
from scheduler.workers import WorkerRecord, WorkerRegistry

log = get_logger()


class WorkerLifecycle:
    """`peer_connected(identity)`: whether a worker socket with that routing identity is connected now (the shell asks
    ZeroMQ); it decides whether a second hello for a worker id comes from a restarted process or from an impostor."""

    def __init__(
        self,
        config: SchedulerConfig,
        workers: WorkerRegistry,
        requests: RequestTable,
        drafts: DraftLink,
        finisher: Finisher,
        endings: Endings,
        outbox: Outbox,
        errors: ProtocolErrors,
        peer_connected: Callable[[bytes], bool],
        wall_clock_ns: Callable[[], int],
    ) -> None:
        self._config = config
        # The wall clock a hello's incarnation (its start time) is checked against: the shell's, or a test's.
        self._wall_clock_ns = wall_clock_ns
        self._workers = workers
        self._requests = requests
        self._drafts = drafts
        self._finisher = finisher
        self._endings = endings
        self._outbox = outbox
        self._errors = errors  # the worker socket's
        self._peer_connected = peer_connected
        self._no_ready_target_since_s: float | None = 0.0  # None from a target's READY report until a tick finds none

    def without_target_since_s(self, now_s: float) -> float | None:
        """Since when no target has been READY (the start, or the first tick that found none after the last READY
        report); None while one is."""
        if self._workers.has_ready_target():
            return None
        if self._no_ready_target_since_s is None:
            self._no_ready_target_since_s = now_s
        return self._no_ready_target_since_s

    def hello(self, identity: bytes, hello: m.WorkerHello, now_s: float) -> bool:
        """Register the process that says this hello, or refuse it; False when it was dropped (not believable, or an
        incarnation already known)."""
        if problem := hello_problem(hello, self._wall_clock_ns()):  # checked in full before any record is built
            self._errors.record("bad_hello", worker_id=hello.worker_id[:64], problem=problem)
            return False
        is_new, replaced = self._workers.replaced_by(hello)
        if not is_new:
            return False
        if replaced is not None and replaced.identity != identity and self._peer_connected(replaced.identity):
            self._refuse_duplicate(identity, hello, replaced)
            return True
        if replaced is not None:
            replaced.failure = replaced.failure or "replaced by a new incarnation"
            self._endings.lose_worker(replaced, State.DEAD, now_s)
        worker = self._workers.register(hello, identity, now_s, prefix_cache=self._config.prefix_cache)
        problem = self._workers.incompatibility(hello)
        log.info(
            "worker.hello",
            worker_id=hello.worker_id,
            incarnation=hello.incarnation,
            role=hello.role,
            fingerprint=hello.model_fingerprint,
            num_kv_pages=hello.num_kv_pages,
            kv_page_size=hello.kv_page_size,
            refused=problem,
        )
        if problem:
            self._refuse(worker, problem, now_s)
        elif not worker.is_target:
            self._drafts.note_hello(worker)
        else:
            vocabulary_was_known = bool(self._workers.target_vocab_size)
            for draft in self._workers.note_target(hello):
                self._refuse(draft, self._workers.draft_problem(draft.hello), now_s)
            if not vocabulary_was_known:
                self._refuse_out_of_vocabulary()
        return True

    def _refuse_duplicate(self, identity: bytes, hello: m.WorkerHello, live: WorkerRecord) -> None:
        """A hello for the id of a process whose connection is still up: the first one stays; the newcomer is told to
        stop (a restarted process is only ever started after its predecessor's connection closed)."""
        self._errors.record("duplicate_id", worker_id=hello.worker_id, incarnation=hello.incarnation)
        log.error(
            "worker.duplicate_refused",
            worker_id=hello.worker_id,
            incarnation=hello.incarnation,
            live_incarnation=live.incarnation,
            note="a process with this id is connected; the one saying hello again is told to stop",
        )
        self._outbox.to_worker(identity, m.Drain(hello.incarnation))

    def _refuse_out_of_vocabulary(self) -> None:
        """Requests queued before any target said hello were admitted without knowing the vocabulary: checked now,
        before a worker can see them (later ones are checked at admission)."""
        for request in self._requests.waiting:
            if problem := token_problem(request, self._workers.target_vocab_size):
                self._finisher.fail(request, "INVALID_ARGUMENT", problem)

    def _refuse(self, worker: WorkerRecord, problem: str, now_s: float) -> None:
        log.error(
            "worker.refused",
            worker_id=worker.worker_id,
            incarnation=worker.incarnation,
            role=worker.hello.role,
            reason=problem,
        )
        worker.failure = f"refused: {problem}"
        worker.move_to(State.FAILED, now_s)
        self._outbox.to_worker(worker.identity, m.Drain(worker.incarnation))

    def reported(self, worker: WorkerRecord, report: m.LifecycleReport, now_s: float) -> bool:
        """Follow a reported transition; one the table does not allow is dropped as a protocol error."""
        state = report.state
        if state not in TRANSITIONS[worker.state]:
            log.warning("worker.illegal_transition", worker_id=worker.worker_id, state=worker.state, reported=state)
            return False
        log.info("worker.lifecycle", worker_id=worker.worker_id, incarnation=worker.incarnation, state=state)
        if state in (State.FAILED, State.STOPPED):
            self._endings.lose_worker(worker, state, now_s)
            return True
        worker.move_to(state, now_s)
        if state is State.READY:
            worker.kernels = report.kernels[:MAX_KERNELS_CHARS]
        if state is State.READY and worker.is_target:
            worker.batch_invariant = report.batch_invariant
            worker.graphs = report.graphs[:MAX_KERNELS_CHARS]
            for timing in report.step_timings[:MAX_STEP_TIMINGS]:  # what rows cost, before any speculative step
                worker.cost.observe_warm_up(
                    StepShape(timing.decode_rows, timing.prefill_tokens, timing.attended), timing.duration_ms
                )
            log.info(
                "worker.step_cost",
                worker_id=worker.worker_id,
                batch_invariant=worker.batch_invariant,
                speculation_policy=self._config.speculation_policy,
                fitted=[round(c, 4) for c in worker.cost.coefficients() or ()],
                terms="fixed ms; ms per decode row up to 8, 9-32, beyond; ms more per row under a grammar; ms per "
                "prefill token; ms per thousand attended positions",
                note="the policy weighs these, the wait for proposals and each request's acceptance",
            )
        if state is State.READY and worker.is_target and report.max_draft_tokens is not None:
            worker.max_draft_tokens = max(0, min(worker.max_draft_tokens, report.max_draft_tokens))
            log.warning(
                "worker.speculation_limited",
                worker_id=worker.worker_id,
                max_draft_tokens=worker.max_draft_tokens,
                note="0: its steps are not batch invariant and it was told --require-batch-invariance",
            )
        if state is State.READY and worker.is_target:
            self._no_ready_target_since_s = None
        if state is State.DRAINING and not worker.is_target:
            self._endings.lose_draft(worker, now_s)  # no proposal goes to a draining draft service
        return True
