"""A request leaving the scheduler, for any reason: its KV pages freed, its speculation state dropped, its gateway
told (the finish reason on its stream, or the error a failed request ends with)."""

from __future__ import annotations

from common.logs import get_logger
from proto import messages as m
from scheduler.outbox import Outbox
from scheduler.request_table import RequestTable
from scheduler.requests import FINISH_REASONS, Request, RequestStatus
from scheduler.speculation.link import DraftLink
from scheduler.workers import WorkerRegistry

log = get_logger()


class Finisher:
    def __init__(self, requests: RequestTable, workers: WorkerRegistry, drafts: DraftLink, outbox: Outbox) -> None:
        self._requests = requests
        self._workers = workers
        self._drafts = drafts
        self._outbox = outbox

    def finish(self, request: Request, status: RequestStatus, *, notify: bool, reason: str = "") -> None:
        """The request leaves the scheduler; its KV pages are free at once (a step in flight that writes them ends
        before the worker runs the next one, the only one that may reuse them)."""
        worker = self._workers.holding(request)
        if worker is not None:
            worker.remove(request)
        request.worker_id = None
        self._drafts.forget_later(request)
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self._drafts.record_completion(request)
        self._requests.finish(request, status)
        log.info(
            "request.finished",
            request_id=request.request_id,
            status=status.value,
            reason=reason or None,
            num_completion_tokens=len(request.output_token_ids),
            num_draft_tokens=request.num_draft_tokens,
            num_accepted_draft_tokens=request.num_accepted_draft_tokens,
            num_verify_steps=request.num_verify_steps,
        )
        if notify and status in FINISH_REASONS:
            self._outbox.emit(request, [], FINISH_REASONS[status])

    def fail(self, request: Request, code: m.ErrorCode, problem: str) -> None:
        """The request fails alone: it leaves the scheduler, and its gateway is told why (a gRPC status code)."""
        self.finish(request, RequestStatus.FAILED, notify=False, reason=problem)
        self._outbox.to_gateway(request.gateway, m.RequestError(request.request_id, code, problem))
