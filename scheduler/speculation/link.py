"""The scheduler's link to the draft service (no I/O): the one object the core asks about speculation.

It knows which draft service proposals go to, decides each planned step's draft tokens,
builds the propose request, keeps the ones not answered yet (and those given up on, whose
late answer still tells what the service holds), checks the answer, stores the target
features a draft head reads, and collects the finished requests the service must forget.
Sending the step, with the proposals or without, stays the core's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from common.logs import get_logger
from common.step_shape import step_shape
from modeling.proposals import drafts_problem
from proto import messages as m
from scheduler.batching import ScheduledSeq, StepPlan
from scheduler.config import SchedulerConfig, speculation_caps
from scheduler.requests import Request, RequestTable
from scheduler.speculation.counters import SpecCounters
from scheduler.speculation.acceptance import expected_accepted
from scheduler.speculation.policy import (PLAN_MARGIN, DraftOption, SpecLimits, Unasked, best_drafts, beyond_reach,
                                          draft_caps, explored)
from scheduler.speculation.state import SpecStates
from scheduler.speculation.views import forget_views
from scheduler.workers import WorkerRecord, WorkerRegistry

log = get_logger()

_ABANDONED_TIMEOUTS = 10  # a timed-out proposal's late answer is still awaited for this many propose timeouts
_STATS_LOG_INTERVAL_S = 10.0  # speculation.stats is logged at most this often


@dataclass(frozen=True)
class PendingProposal:
    """A target worker's planned step, waiting for the draft service's proposals."""

    propose_id: int
    worker_id: str
    worker_incarnation: int
    plan: StepPlan
    sent_at_s: float


def proposal_problem(proposal: m.Proposal, num_tokens: int, vocab_size: int, sequence_len: int) -> str:
    """Why a proposal cannot be verified ("" when it can): a bad draft must never reach a target."""
    if not 0 <= proposal.num_held <= sequence_len:
        return f"num_held {proposal.num_held} for a sequence of {sequence_len} tokens"
    if len(proposal.token_ids) > num_tokens:
        return f"{len(proposal.token_ids)} tokens proposed, {num_tokens} asked for"
    return drafts_problem(proposal.token_ids, proposal.parents, proposal.dists, vocab_size)


class DraftLink:
    def __init__(self, config: SchedulerConfig) -> None:
        self._config = config
        self._pending: dict[int, PendingProposal] = {}  # propose requests the draft service has not answered
        self._abandoned: dict[int, PendingProposal] = {}  # timed out; a late answer still updates the draft views
        self._next_propose_id = 0
        self._forget: list[str] = []  # finished requests the draft service must forget, sent once per event
        self._in_use: tuple[str, int] | None = None  # (worker_id, incarnation) the requests' draft views describe
        self._stats_logged_s = 0.0
        # A draft that reads target features has said hello (and was not refused): every step returns them.
        self.features_wanted = False
        self.counters = SpecCounters(policy=config.speculation_policy)
        self.states = SpecStates()  # each running request's draft view, drafts' record and target features
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

    # ------------------------------------------------------------------ plan and propose

    def draft_tokens(self, draft: WorkerRecord | None, target: WorkerRecord, seqs: Sequence[ScheduledSeq]) -> dict[str, int]:
        """k per request id for a step of `target` (empty: it runs without proposals); counted by the largest k."""
        num_tokens: dict[str, int] = {}
        if draft is not None:
            cfg = self._config
            k, threshold = self._caps(draft.hello.draft_kind)
            limits = SpecLimits(
                num_speculative_tokens=min(k, target.max_draft_tokens, draft.hello.max_draft_tokens),
                spec_disable_batch_threshold=threshold,
                spec_draft_token_budget=cfg.spec_draft_token_budget,
                max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len,
            )
            num_tokens = self._with_features(draft, seqs, draft_caps(seqs, limits))
            if num_tokens and cfg.speculation_policy == "goodput":
                num_tokens = self._paying(target, seqs, num_tokens)
        self.counters.decide(max(num_tokens.values(), default=0))
        return num_tokens

    def _caps(self, draft_kind: str) -> tuple[int, int]:
        if (caps := self._caps_by_kind.get(draft_kind)) is None:
            caps = self._caps_by_kind[draft_kind] = speculation_caps(self._config, draft_kind)
        return caps

    def _with_features(self, draft: WorkerRecord, seqs: Sequence[ScheduledSeq],
                       num_tokens: dict[str, int]) -> dict[str, int]:
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

    def _paying(self, target: WorkerRecord, seqs: Sequence[ScheduledSeq], caps: dict[str, int]) -> dict[str, int]:
        """Of the caps, the k that maximise the step's expected tokens per second, by each request's record over all
        sources and the wait for a proposal (policy.py), and the requests asked for to try them (`explored`); empty:
        plain decoding pays best, or the target's step time is not known yet."""
        server = self.counters.acceptance
        outlooks = {item.request.request_id: self.states.of(item.request.request_id).acceptance.outlook(
                        caps[item.request.request_id], server) for item in seqs if caps.get(item.request.request_id, 0) > 0}
        propose = self.counters.propose_cost
        ks, base_ms = _best_drafts(target, seqs, outlooks, lambda ks: propose.predict_ms(max(ks.values()), len(ks)),
                                   PLAN_MARGIN)
        if base_ms > 0.0:
            row_ms = target.cost.row_ms(len(seqs), 1)
            candidates = [Unasked(item.request.request_id, self.states.of(item.request.request_id).acceptance.unasked_steps,
                                  target.cost.extra_ms(1, item.request.num_computed_tokens, row_ms,
                                                       item.request.grammar is not None))
                          for item in seqs if item.request.request_id in outlooks and item.request.request_id not in ks]
            trying = explored(candidates, propose.predict_ms(max(caps.values()), 1), target.explore, bool(ks))
            for item in seqs:
                self.states.of(item.request.request_id).acceptance.exploring = item.request.request_id in trying
            ks.update({rid: caps[rid] for rid in trying})
        # Where a longer proposal costs the draft next to nothing (a lookup), the whole cap is asked for: what of it is
        # verified is decided when it comes (`trim`), by its source's record.
        longest = propose.predict_ms(max(caps[rid] for rid in ks), len(ks)) if ks else 0.0
        if ks and longest - propose.predict_ms(max(ks.values()), len(ks)) <= 0.01 * base_ms:
            ks = {rid: caps[rid] for rid in ks}
        return ks

    def trim(self, target: WorkerRecord, plan: StepPlan, proposals: dict[str, m.Proposal]) -> dict[str, m.Proposal]:
        """Each proposal cut to the length (a tree: the nodes) that pays, by its source's record, now that the wait for
        it is spent (`--speculation-policy goodput`; else as they came)."""
        if not proposals or self._config.speculation_policy != "goodput" or target.cost.coefficients() is None:
            return proposals
        server = self.counters.acceptance
        outlooks: dict[str, list[tuple[float, list[float]]]] = {}
        for item in plan.seqs:
            rid = item.request.request_id
            if (proposal := proposals.get(rid)) is not None:
                acceptance = self.states.of(rid).acceptance
                if proposal.parents is None:
                    gains = expected_accepted(acceptance.rates(proposal.source, len(proposal.token_ids), server))
                else:  # a tree's nodes at one depth are alternatives: each brings its own chance of being accepted
                    gains = acceptance.tree_gains(proposal.source, len(proposal.token_ids), server)
                outlooks[rid] = [(1.0, gains)]
        ks, _ = _best_drafts(target, plan.seqs, outlooks, lambda ks: 0.0, 0.0)
        for item in plan.seqs:  # one asked for to try it has a draft token verified at least, or nothing is learned
            if self.states.of(item.request.request_id).acceptance.exploring and item.request.request_id in proposals:
                ks[item.request.request_id] = max(ks.get(item.request.request_id, 0), 1)
        return {rid: _first_nodes(proposal, ks[rid]) for rid, proposal in proposals.items() if ks.get(rid, 0) > 0}

    def propose(self, draft: WorkerRecord, target: WorkerRecord, plan: StepPlan, now_s: float) -> m.ProposeRequest:
        """The propose request for `target`'s planned step, which now waits for its answer."""
        self._next_propose_id += 1
        seqs = []
        for item in plan.seqs:
            r = item.request
            if r.request_id not in plan.num_draft_tokens:
                continue
            state = self.states.of(r.request_id)
            view = state.draft
            view.known = True
            features = None
            if draft.hello.feature_width:
                features = state.features.rows_from(view.num_features, r.num_tokens - 1)
                view.num_features = r.num_tokens - 1
            seqs.append(m.ProposeSeq(
                request_id=r.request_id, num_held=view.num_held, num_drop=view.num_proposed,
                new_token_ids=r.token_slice(view.num_stable, r.num_tokens), num_tokens=plan.num_draft_tokens[r.request_id],
                sampling=r.sampling, features=features,
            ))
        pending = PendingProposal(self._next_propose_id, target.worker_id, target.incarnation, plan, now_s)
        self._pending[pending.propose_id] = pending
        target.awaiting_proposal = pending.propose_id
        return m.ProposeRequest(pending.propose_id, draft.incarnation, seqs)

    def answer(self, result: m.ProposeResult, requests: RequestTable, vocab_size: int,
               report: Callable[[str], None], now_s: float) -> tuple[PendingProposal, dict[str, m.Proposal]] | None:
        """The pending request answered and its usable proposals; None for an answer nobody waits for.

        Every proposal updates what the request's draft view says the service holds; one
        that cannot be verified is reported and dropped.
        """
        pending = self._pending.pop(result.propose_id, None) or self._abandoned.pop(result.propose_id, None)
        if pending is None:
            return None
        self.counters.proposed(result.duration_ms, (now_s - pending.sent_at_s) * 1000)
        asked = pending.plan.num_draft_tokens
        proposals: dict[str, m.Proposal] = {}
        for proposal in result.proposals:
            request = requests.get(proposal.request_id)
            if request is None or proposal.request_id not in asked:
                continue
            state = self.states.of(request.request_id)
            problem = proposal_problem(proposal, asked[proposal.request_id], vocab_size, request.num_tokens)
            if problem:
                report(problem)
                state.draft.reset()
                continue
            # Whatever happens to the step, the draft service now holds this.
            state.draft.num_stable, state.draft.num_proposed = proposal.num_held, len(proposal.token_ids)
            state.acceptance.asked(proposal.source if proposal.token_ids else None)
            self.counters.acceptance.asked(proposal.source if proposal.token_ids else None)
            if proposal.num_held == 0:  # it started the sequence over: it holds no features either
                state.draft.num_features = 0
            if proposal.token_ids:
                proposals[proposal.request_id] = proposal
        return pending, proposals

    # ------------------------------------------------------------------ target features

    def store_features(self, target: WorkerRecord, features: list[m.SeqFeatures], report: Callable[[str], None]) -> None:
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

    # ------------------------------------------------------------------ giving up, losing, forgetting

    def pending(self, propose_id: int) -> PendingProposal | None:
        """The unanswered propose request of that id, if any."""
        return self._pending.get(propose_id)

    def timed_out(self, now_s: float) -> list[PendingProposal]:
        """Pending requests past the propose timeout (to give up on); forgets abandoned ones too old to be answered."""
        too_old = _ABANDONED_TIMEOUTS * self._config.propose_timeout_s
        for pending in [p for p in self._abandoned.values() if now_s - p.sent_at_s > too_old]:
            del self._abandoned[pending.propose_id]  # no answer will come now; the views were reset at the timeout
        return [p for p in self._pending.values() if now_s - p.sent_at_s > self._config.propose_timeout_s]

    def give_up(self, pending: PendingProposal, requests: RequestTable, *, answer_may_come: bool) -> None:
        """What the draft holds for these requests is unknown until its answer comes, if it does."""
        self._pending.pop(pending.propose_id, None)
        if answer_may_come:
            self._abandoned[pending.propose_id] = pending
        for request_id in pending.plan.num_draft_tokens:
            if requests.get(request_id) is not None:
                self.states.of(request_id).draft.reset()

    def lose(self, draft: WorkerRecord) -> list[PendingProposal]:
        """The draft service went: the pending requests to give up (no answer will come); none if it was not in use."""
        if self._in_use != (draft.worker_id, draft.incarnation):
            return []  # not the one proposals went to: nothing depends on it
        self._in_use = None
        forget_views(state.draft for state in self.states)
        self._abandoned.clear()
        return list(self._pending.values())

    def forget_later(self, request: Request) -> None:
        """A finished request: its state goes, and if the draft service holds it, the service is told to forget it at
        the end of the event."""
        state = self.states.drop(request.request_id)
        if state is not None and state.draft.known:
            self._forget.append(request.request_id)

    def draft_generation(self, request: Request) -> int:
        """The generation of what the draft service holds of the request (a result for an older one moves nothing)."""
        return self.states.of(request.request_id).draft.generation

    def take_forget(self) -> list[str]:
        forget, self._forget = self._forget, []
        return forget

    def log_stats(self, now_s: float) -> None:
        if now_s - self._stats_logged_s >= _STATS_LOG_INTERVAL_S and self.counters.num_draft_tokens:
            self._stats_logged_s = now_s
            log.info("speculation.stats", **msgspec.structs.asdict(self.counters.info()))


# What a step carries of a proposal: its tokens, their distributions, its tree.
DraftWork = tuple[list[int], list[m.SparseDist] | None, list[int] | None]


def draft_work(request: Request, proposal: m.Proposal | None) -> DraftWork:
    """What a step carries of a proposal: its tokens, their distributions (only where the request samples), its tree."""
    if proposal is None:
        return [], None, None
    dists = None if request.sampling.is_greedy else proposal.dists
    return proposal.token_ids, dists, proposal.parents  # a tree is of point masses (checked on arrival)


def _best_drafts(target: WorkerRecord, seqs: Sequence[ScheduledSeq], outlooks: dict[str, list[tuple[float, list[float]]]],
                 wait_ms: Callable[[dict[str, int]], float], margin: float) -> tuple[dict[str, int], float]:
    """k per request (none of 0) that maximises the step's expected tokens per ms, each request's drafts turning out
    as its outlook says ((chance, tokens its first k bring) per source that may answer), and the plain step's
    predicted time; ({}, 0) while the target's step time is not known."""
    shape = step_shape([(item.num_tokens, 0, item.request.num_computed_tokens,
                         item.completes and item.request.grammar is not None) for item in seqs])
    base_ms = target.cost.predict_ms(shape)
    if base_ms is None or not outlooks:
        return {}, base_ms or 0.0
    longest = {rid: max(len(gains) for _, gains in outlook) for rid, outlook in outlooks.items()}
    # Rows cost by where the step stands on the curve: its own rows, and the drafts that may join them.
    row_ms = target.cost.row_ms(shape.decode_rows, sum(n - 1 for n in longest.values()))
    base_tokens = sum(1 for item in seqs if item.completes)
    # An ask waits at least what one token of one sequence does (the wait's fitted parts are never negative).
    if beyond_reach(outlooks.values(), base_tokens / base_ms * (1 + margin), row_ms, wait_ms({"": 1})):
        return {}, base_ms
    requests = {item.request.request_id: item.request for item in seqs}
    options = [DraftOption(rid, [target.cost.extra_ms(n, requests[rid].num_computed_tokens, row_ms,
                                                      requests[rid].grammar is not None) for n in range(longest[rid])],
                           outlook)
               for rid, outlook in outlooks.items()]
    return best_drafts(options, base_tokens, base_ms, wait_ms, margin), base_ms


def _first_nodes(proposal: m.Proposal, n: int) -> m.Proposal:
    """The proposal's first n nodes (a tree's: a tree too, since a node's parent comes before it)."""
    if n >= len(proposal.token_ids):
        return proposal
    return msgspec.structs.replace(
        proposal, token_ids=proposal.token_ids[:n], dists=None if proposal.dists is None else proposal.dists[:n],
        parents=None if proposal.parents is None else proposal.parents[:n])
