"""What ends when a process or a gateway is lost: a worker's requests back to the queue (and the one it keeps
killing quarantined), a draft service's proposals given up, a gone gateway's requests aborted."""

from __future__ import annotations

from common.logs import get_logger
from proto import messages as m
from proto.lifecycle import State
from scheduler.config import SchedulerConfig
from scheduler.finishing import Finisher
from scheduler.gateways import GatewayRecord
from scheduler.outbox import Outbox
from scheduler.request_table import RequestTable
from scheduler.requests import RequestStatus
from scheduler.speculation.link import DraftLink
from scheduler.stepping import StepCycle
from scheduler.workers import WorkerRecord

log = get_logger()


class Endings:
    def __init__(
        self,
        config: SchedulerConfig,
        requests: RequestTable,
        drafts: DraftLink,
        finisher: Finisher,
        steps: StepCycle,
        outbox: Outbox,
    ) -> None:
        self._config = config
        self._requests = requests
        self._drafts = drafts
        self._finisher = finisher
        self._steps = steps
        self._outbox = outbox
        self.num_gone_gateways = 0  # since start: gateways missing past the grace window
        self.num_orphaned_requests = 0  # since start: requests aborted because their gateway was gone

    def _quarantine(self, worker: WorkerRecord, now_s: float) -> None:
        """The requests of the step in flight on a lost worker count the loss. In two lost steps a request becomes a
        suspect and runs in steps of its own; one whose own step is in flight on a lost worker after more than
        --max-request-retries losses fails. So one request that kills every worker it meets cannot take the service
        down, and the others in its batch do not share its fate."""
        if worker.in_flight is None:
            return
        alone = len(worker.in_flight.seqs) == 1
        for seq in worker.in_flight.seqs:
            request = seq.request
            if worker.requests.get(request.request_id) is not request:
                continue
            request.num_lost_steps += 1
            # Once could be chance (a worker killed for its own reasons); twice, it runs alone from now on, so that
            # the next loss points at it or clears the others.
            request.suspect = request.num_lost_steps >= 2
            if alone and request.num_lost_steps > self._config.max_request_retries:
                problem = (
                    f"the request was in flight on {request.num_lost_steps} workers that were lost (last: "
                    f"{worker.worker_id}, {worker.failure}); it is not run again (--max-request-retries "
                    f"{self._config.max_request_retries})"
                )
                log.error("request.quarantined", request_id=request.request_id, reason=problem)
                self._finisher.fail(request, "INTERNAL", problem)

    def orphan_requests(self, gateway: GatewayRecord, now_s: float, problem: str, *, notify: bool = True) -> None:
        """A gateway missing past the grace window, or replaced by a new process under its identity, is gone: nobody
        reads its requests' tokens, so they end, waiting and running alike, and their pages are free for the others.
        With `notify`, each is also told UNAVAILABLE, for a gateway that only hung with its connection up and reads it
        later."""
        orphans = [r for r in self._requests if r.gateway == gateway.identity]
        num_running = sum(r.status is RequestStatus.RUNNING for r in orphans)
        for request in orphans:
            self._finisher.finish(request, RequestStatus.FINISHED_ABORTED, notify=False, reason=problem)
            if notify:  # (not a process that replaced it: it never knew them)
                self._outbox.to_gateway(gateway.identity, m.RequestError(request.request_id, "UNAVAILABLE", problem))
        self.num_gone_gateways += 1
        self.num_orphaned_requests += len(orphans)
        log.warning(
            "gateway.gone",
            gateway_id=gateway.gateway_id,
            because=gateway.missing_because,
            missing_for_s=round(now_s - gateway.missing_since_s, 3),
            num_aborted=len(orphans),
            num_running=num_running,
            num_waiting=len(orphans) - num_running,
        )

    def lose_draft(self, draft: WorkerRecord, now_s: float) -> None:
        """Steps go on without speculation; a new incarnation starts from nothing."""
        for pending in self._drafts.lose(draft):
            self._steps.give_up_proposal(pending, now_s, answer_may_come=False)

    def fail_worker(self, worker: WorkerRecord, failure: str, now_s: float) -> None:
        """The worker failed (it said so, or broke the protocol): FAILED with the reason it is listed with."""
        worker.failure = failure
        self.lose_worker(worker, State.FAILED, now_s)

    def lose_worker(self, worker: WorkerRecord, state: State, now_s: float) -> None:
        """The worker will run nothing more: its requests go back to the front of the queue.

        It is told to stop as well: one given up on while still alive (silent too long, a
        refused step, a bad result) would otherwise run on, heartbeating, with nobody to
        serve and no supervisor to restart it. A dead one never reads it.
        """
        log.warning(
            "worker.lost",
            worker_id=worker.worker_id,
            incarnation=worker.incarnation,
            state=state,
            failure=worker.failure,
            num_requeued=len(worker.requests),
        )
        if worker.is_target:
            self._quarantine(worker, now_s)
        if not worker.told_to_stop:
            worker.told_to_stop = True
            self._outbox.to_worker(worker.identity, m.Drain(worker.incarnation))
        worker.move_to(state, now_s)
        worker.in_flight = None
        worker.awaiting_proposal = None  # its pending proposal, when answered, only updates the draft views
        if not worker.is_target:
            self.lose_draft(worker, now_s)
            return
        self._requests.requeue(list(worker.requests.values()), now_s)
        worker.lose_pages()
