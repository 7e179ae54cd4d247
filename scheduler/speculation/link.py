"""The scheduler's link to the draft service (no I/O): the one object the core asks about speculation.

It knows which draft service proposals go to, decides each planned step's draft tokens
(policy.py's caps, narrowed to what the draft can serve and, under the goodput policy, to
what pays: goodput.py), holds the propose requests in flight (proposing.py), stores the
target features a draft head reads, and collects the finished requests the service must
forget. Sending the step, with the proposals or without, stays the step cycle's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec

from common.logs import get_logger
from proto import messages as m
from scheduler.batching import ScheduledSeq, StepPlan
from scheduler.config import SchedulerConfig, runs_a_model, speculation_caps
from scheduler.outbox import Outbox
from scheduler.requests import Request
from scheduler.speculation.counters import SpecCounters
from scheduler.speculation.goodput import paying_drafts, trimmed
from scheduler.speculation.policy import SpecLimits, draft_caps
from scheduler.speculation.proposing import PendingProposal, ProposeRequests
from scheduler.speculation.state import SpecStates
from scheduler.speculation.views import forget_views
from scheduler.workers import WorkerRecord, WorkerRegistry

log = get_logger()

_STATS_LOG_INTERVAL_S = 10.0  # speculation.stats is logged at most this often


class DraftLink:
    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._forget: list[str] = []  # finished requests the draft service must forget, sent once per event
        self._texts: list[tuple[str, list[int]]] = []  # (tenant, tokens) served, for a draft that learns from traffic
        # A draft that learns from traffic has said hello: from then on the text served is recorded for it.
        self.learning = False
        self._in_use: tuple[str, int] | None = None  # (worker_id, incarnation) the requests' draft views describe
        self._stats_logged_s = 0.0
        # A draft that reads target features has said hello (and was not refused): every step returns them.
        self.features_wanted = False
        self.counters = SpecCounters(policy=config.speculation_policy)
        self.states = SpecStates()  # each running request's draft view, drafts' record and target features
        self.proposals = ProposeRequests(config.propose_timeout_s, self.states, self.counters)
        self._caps_by_kind: dict[str, tuple[int, int]] = {}  # speculation_caps by draft kind, worked out once

    # ------------------------------------------------------------------ which draft service

    def current(self, workers: WorkerRegistry) -> WorkerRecord | None:
        """The draft service proposals go to: the one in use while it is READY, else the first READY one."""
        in_use = self._in_use
        current = workers.current(*in_use) if in_use else None
        if current is not None and current.is_ready:
            return current
        draft = workers.ready_draft()
        if draft is not None:
            forget_views(state.draft for state in self.states)  # another draft (incarnation) holds none of it
            self._in_use = (draft.worker_id, draft.incarnation)
        return draft

    def note_hello(self, draft: WorkerRecord) -> None:
        """From the first hello of a draft that reads target features on, every step returns them.

        Kept on when that draft goes away: a restarted draft then finds every running
        request's features complete, where a gap would cost the request speculation for good.
        """
        if draft.hello.feature_width > 0:
            self.features_wanted = True
        if draft.hello.learns_from_traffic:
            self.learning = True

    def record_prompt(self, request: Request) -> None:
        """An admitted request's prompt (its end, as the frame allows), for a draft that learns from traffic."""
        if self.learning:
            self._texts.append((request.tenant, request.prompt_token_ids[-self._config.max_model_len :]))

    def record_completion(self, request: Request) -> None:
        """A finished request's completion after its prompt's last m.COMPLETION_LEAD_IN tokens (what followed a
        prompt's end is then found where the end is), for a draft that learns from traffic."""
        if self.learning and request.output_token_ids:
            text = request.prompt_token_ids[-m.COMPLETION_LEAD_IN :] + request.output_token_ids
            self._texts.append((request.tenant, text[-self._config.max_model_len :]))

    def lose(self, draft: WorkerRecord) -> list[PendingProposal]:
        """The draft service went: the pending requests to give up (no answer will come); none if it was not in use."""
        if self._in_use != (draft.worker_id, draft.incarnation):
            return []  # not the one proposals went to: nothing depends on it
        self._in_use = None
        forget_views(state.draft for state in self.states)
        return self.proposals.lost()

    def draft_generation(self, request: Request) -> int:
        """The generation of what the draft service holds of the request (a result for an older one moves nothing)."""
        return self.states.of(request.request_id).draft.generation

    # ------------------------------------------------------------------ draft tokens

    def draft_tokens(
        self, draft: WorkerRecord | None, target: WorkerRecord, seqs: Sequence[ScheduledSeq]
    ) -> dict[str, int]:
        """k per request id for a step of `target` (empty: it runs without proposals); counted by the largest k."""
        num_tokens: dict[str, int] = {}
        if draft is not None:
            cfg = self._config
            k, threshold = self._caps(draft.hello.draft_kind)
            limits = SpecLimits(
                num_speculative_tokens=min(k, target.max_draft_tokens, draft.hello.max_draft_tokens),
                spec_disable_batch_threshold=threshold,
                spec_draft_token_budget=cfg.spec_draft_token_budget,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_model_len=cfg.max_model_len,
            )
            num_tokens = self._with_features(draft, seqs, draft_caps(seqs, limits))
            if num_tokens and cfg.speculation_policy == "goodput":
                lookups = not runs_a_model(draft.hello.draft_kind)
                num_tokens = paying_drafts(target, seqs, num_tokens, self.counters, self.states, lookups)
        self.counters.decide(max(num_tokens.values(), default=0))
        return num_tokens

    def _caps(self, draft_kind: str) -> tuple[int, int]:
        if (caps := self._caps_by_kind.get(draft_kind)) is None:
            caps = self._caps_by_kind[draft_kind] = speculation_caps(self._config, draft_kind)
        return caps

    def _with_features(
        self, draft: WorkerRecord, seqs: Sequence[ScheduledSeq], num_tokens: dict[str, int]
    ) -> dict[str, int]:
        """For a draft that reads target features, only the sequences whose every feature is at hand."""
        if not draft.hello.feature_width:
            return num_tokens
        requests = {item.request.request_id: item.request for item in seqs}
        at_hand = {}
        for request_id, k in num_tokens.items():
            state = self.states.of(request_id)
            if state.draft.num_features > state.features.count:
                state.draft.reset()  # it holds rows that were recomputed or lost here since: it starts over
            if state.features.count >= requests[request_id].num_tokens - 1:  # every position but the last has one
                at_hand[request_id] = k
        return at_hand

    def trim(self, target: WorkerRecord, plan: StepPlan, proposals: dict[str, m.Proposal]) -> dict[str, m.Proposal]:
        """Each proposal cut to the length that pays now that the wait for it is spent (`--speculation-policy goodput`:
        goodput.trimmed; else as they came)."""
        if not proposals or self._config.speculation_policy != "goodput" or target.cost.coefficients() is None:
            return proposals
        return trimmed(target, plan.seqs, proposals, self.counters, self.states)

    # ------------------------------------------------------------------ target features

    def store_features(
        self, target: WorkerRecord, features: list[m.SeqFeatures], report: Callable[[str], None]
    ) -> None:
        """Keep the feature rows a step returned for the requests still running on `target`."""
        for rows in features:
            if rows.request_id not in target.requests:
                continue
            store = self.states.of(rows.request_id).features
            if problem := store.problem(rows.rows):
                report(problem)
                store.clear()
            elif not store.put(rows.rows):
                store.clear()  # a gap (the steps before were not asked for features): none until recomputed

    # ------------------------------------------------------------------ forgetting

    def forget_later(self, request: Request) -> None:
        """A finished request: its state goes, and if the draft service holds it, the service is told to forget it at
        the end of the event."""
        state = self.states.drop(request.request_id)
        if state is not None and state.draft.known:
            self._forget.append(request.request_id)

    def tell_draft(self, workers: WorkerRegistry, outbox: Outbox) -> None:
        """What the draft service is told at the end of an event: the finished requests it must forget, and the text
        served since the last event if it learns from traffic."""
        forget, self._forget = self._forget, []
        texts, self._texts = self._texts, []
        draft = self.current(workers) if forget or texts else None
        if draft is None:
            return
        if forget:
            outbox.to_worker(draft.identity, m.ReleaseSequences(draft.incarnation, forget))
        if draft.hello.learns_from_traffic:
            for tenant, tokens in texts:
                outbox.to_worker(draft.identity, m.RecordText(draft.incarnation, tenant, tokens))

    def log_stats(self, now_s: float) -> None:
        if now_s - self._stats_logged_s >= _STATS_LOG_INTERVAL_S and self.counters.num_draft_tokens:
            self._stats_logged_s = now_s
            log.info("speculation.stats", **msgspec.structs.asdict(self.counters.info()))
