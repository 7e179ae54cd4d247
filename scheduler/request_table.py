"""Every unfinished request by id, and the waiting queue in the order its requests will be placed: admission, the
queue's order (first come first served, or by priority), a request's start on a worker, its requeue and its end."""

from __future__ import annotations

import bisect
import random
from collections import deque
from collections.abc import Iterable, Iterator

import msgspec

from proto import messages as m
from scheduler.admission import RequestRejected, granted_max_tokens, submit_problem
from scheduler.requests import Request, RequestStatus


def _queue_key(request: Request) -> tuple[int, int]:
    """Where a request stands under --scheduling-policy priority: lower priority values first, then earlier arrivals."""
    return request.priority, request.arrival


class RequestTable:
    """Every unfinished request by id, and the waiting ones in the order they will be placed."""

    def __init__(
        self, max_model_len: int, max_queue_len: int, rng: random.Random, *, by_priority: bool = False
    ) -> None:
        self._max_model_len = max_model_len
        self._max_queue_len = max_queue_len
        self._rng = rng
        self._by_priority = by_priority  # --scheduling-policy priority: the queue in (priority, arrival) order
        self._by_id: dict[str, Request] = {}
        self._waiting: deque[Request] = deque()
        self._num_admitted = 0

    def get(self, request_id: str) -> Request | None:
        return self._by_id.get(request_id)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._by_id.values())

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._by_id) - len(self._waiting)

    @property
    def waiting(self) -> list[Request]:
        return list(self._waiting)

    def admit(self, gateway: bytes, submit: m.SubmitRequest, now_s: float, *, vocab_size: int = 0) -> Request:
        """Queue a submitted request; raises RequestRejected, changing nothing, when it cannot be served
        (admission.submit_problem, with `vocab_size` the targets' vocabulary, 0 while none is known) or the queue is
        full."""
        problem = submit_problem(submit, self._by_id, self._max_model_len, vocab_size, by_priority=self._by_priority)
        if problem:
            raise RequestRejected("INVALID_ARGUMENT", problem)
        if len(self._waiting) >= self._max_queue_len:
            raise RequestRejected("RESOURCE_EXHAUSTED", f"the queue is full ({self._max_queue_len} waiting requests)")
        sampling = submit.sampling
        if not submit.seed_given:
            sampling = msgspec.structs.replace(sampling, seed=self._rng.getrandbits(63))
        request = Request(
            request_id=submit.request_id,
            gateway=gateway,
            prompt_token_ids=list(submit.prompt_token_ids),
            max_tokens=granted_max_tokens(submit, self._max_model_len),
            sampling=sampling,
            stop_token_ids=frozenset(submit.stop_token_ids),
            waiting_since_s=now_s,
            num_logprobs=-1 if submit.logprobs is None else submit.logprobs,
            num_prompt_logprobs=-1 if submit.prompt_logprobs is None else submit.prompt_logprobs,
            num_resumed_tokens=submit.resumed_tokens,
            grammar=submit.grammar,
            cache_salt=submit.cache_salt,
            tenant=submit.tenant,
            priority=submit.priority,
            arrival=self._num_admitted,
        )
        self._num_admitted += 1
        self._by_id[request.request_id] = request
        self._enqueue(request, front=False)
        return request

    def _enqueue(self, request: Request, *, front: bool) -> None:
        """Into the queue: in (priority, arrival) order by priority; else at the back, or the front (`front`)."""
        if self._by_priority:
            index = bisect.bisect_right(self._waiting, _queue_key(request), key=_queue_key)
            self._waiting.insert(index, request)
        elif front:
            self._waiting.appendleft(request)
        else:
            self._waiting.append(request)

    def preemption_order(self, running: Iterable[Request]) -> list[Request]:
        """Running requests in the order a worker out of pages preempts them: the last placed first; by priority, the
        lowest priority (largest value) first, the latest admitted first among equals."""
        ordered = list(running)[::-1]
        if self._by_priority:
            ordered.sort(key=_queue_key, reverse=True)
        return ordered

    def first_waiting(self) -> Request | None:
        return self._waiting[0] if self._waiting else None

    def start(self, request: Request, worker_id: str, num_cached_tokens: int) -> None:
        """The first waiting request now runs on that worker, its first `num_cached_tokens` tokens' keys and values
        found in the prefix cache."""
        assert self._waiting[0] is request
        self._waiting.popleft()
        request.move_to(RequestStatus.RUNNING)
        request.worker_id = worker_id
        request.num_computed_tokens = num_cached_tokens
        if not request.output_token_ids and not request.num_preemptions:  # its first placement: what usage reports
            request.num_cached_tokens = min(num_cached_tokens, len(request.prompt_token_ids))

    def requeue(self, requests: list[Request], now_s: float) -> None:
        """Running requests whose worker was lost (or that were preempted) go back to the front of the queue, in
        their order (by priority: to the front of their priority's requests, among which they came first).

        Each is recomputed from its prompt and the tokens already streamed.
        """
        for request in reversed(requests):
            request.move_to(RequestStatus.WAITING)
            request.worker_id = None
            request.num_computed_tokens = 0
            request.waiting_since_s = now_s
            self._enqueue(request, front=True)  # by priority: before every later arrival of its priority

    def finish(self, request: Request, status: RequestStatus) -> None:
        """The request leaves the table (and the queue); its worker's pages are the caller's to free."""
        if request.status is RequestStatus.WAITING:
            self._waiting.remove(request)
        request.move_to(status)
        del self._by_id[request.request_id]
