"""The KV pages a step's new tokens need, taken when the step is sent.

When a worker has too few, a proposal that does not fit is dropped first (the step
verifies nothing for that sequence); then the most recently placed sequence on the worker
(under --scheduling-policy priority, the lowest priority's) is preempted by recompute: its
pages go back, and it returns to the front of the queue to be recomputed from its own
tokens, as after a worker's death (its computed full pages stay in the prefix cache, so the
recompute is mostly a cache hit). After a step, pages past the tokens that stand (rejected
drafts) go back, and newly filled pages join the prefix cache (step_results.py).
"""

from __future__ import annotations

from common.logs import get_logger
from scheduler.batching import ScheduledSeq
from scheduler.finishing import Finisher
from scheduler.request_table import RequestTable
from scheduler.requests import Request, RequestStatus
from scheduler.speculation.proposing import DraftWork
from scheduler.workers import WorkerRecord

log = get_logger()


class StepPaging:
    def __init__(self, requests: RequestTable, finisher: Finisher) -> None:
        self._requests = requests
        self._finisher = finisher

    def fit(
        self, worker: WorkerRecord, wanted: list[tuple[ScheduledSeq, DraftWork]], now_s: float
    ) -> list[tuple[ScheduledSeq, DraftWork]]:
        """Of the step's sequences, each with the drafts it would verify, those that got pages for their new tokens.

        A proposal that does not fit is dropped; then the most recently placed sequence (by priority: the lowest
        priority's, `RequestTable.preemption_order`) is preempted until the pages are there. A sequence that alone
        needs more pages than the worker has finishes (its context is full).
        """
        pages = worker.pages
        assert pages is not None  # a target that runs steps
        preempted: set[str] = set()
        work: list[tuple[ScheduledSeq, DraftWork]] = []
        for item, drafts in wanted:
            r = item.request
            if r.request_id in preempted:
                continue
            need = r.num_computed_tokens + item.num_tokens
            if drafts[0] and not pages.grow(r.request_id, need + len(drafts[0])):
                drafts = ([], None, None)  # verified never: the draft service drops it with the next request
            while r.request_id not in preempted and not pages.grow(r.request_id, need):
                victim = self._requests.preemption_order(worker.requests.values())[0]
                if victim is r and len(worker.requests) == 1:
                    log.warning(
                        "request.kv_cache_full",
                        request_id=r.request_id,
                        num_tokens=need,
                        num_kv_pages=pages.num_pages,
                        note="alone it needs more pages than the worker has",
                    )
                    self._finisher.finish(r, RequestStatus.FINISHED_LENGTH, notify=True, reason="the KV cache is full")
                    preempted.add(r.request_id)
                    break
                self._preempt(worker, victim, now_s)
                preempted.add(victim.request_id)
            if r.request_id not in preempted:
                work.append((item, drafts))
        return [(item, drafts) for item, drafts in work if item.request.request_id not in preempted]

    def _preempt(self, worker: WorkerRecord, request: Request, now_s: float) -> None:
        """Free the request's pages; it waits at the front of the queue, to be recomputed from its own tokens."""
        worker.remove(request)
        worker.num_preemptions += 1
        request.num_preemptions += 1
        self._requests.requeue([request], now_s)
        log.info(
            "request.preempted",
            request_id=request.request_id,
            worker_id=worker.worker_id,
            num_tokens=request.num_tokens,
            num_preemptions=request.num_preemptions,
        )
