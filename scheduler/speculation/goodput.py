"""The goodput rule (policy.py) put to one target's step: which requests are asked for how many draft tokens when
the step is planned, and how much of each proposal is verified when it comes, from the target's step-time fit, the
wait for proposals and each request's acceptance record."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import msgspec

from common.step_shape import step_shape
from proto import messages as m
from scheduler.batching import ScheduledSeq
from scheduler.speculation.acceptance import expected_accepted
from scheduler.speculation.chances import chance_gains
from scheduler.speculation.counters import SpecCounters
from scheduler.speculation.policy import PLAN_MARGIN, DraftOption, Unasked, best_drafts, beyond_reach, explored
from scheduler.speculation.state import SpecStates
from scheduler.workers import WorkerRecord


def paying_drafts(
    target: WorkerRecord,
    seqs: Sequence[ScheduledSeq],
    caps: dict[str, int],
    counters: SpecCounters,
    states: SpecStates,
    lookups: bool = False,
) -> dict[str, int]:
    """Of the caps, the k that maximise the step's expected tokens per second, by each request's record over all
    sources and the wait for a proposal (policy.py), and the requests asked for to try them (`explored`); empty:
    plain decoding pays best, or the target's step time is not known yet. A request asked for gets its whole cap
    where the draft is a lookup (`lookups`: it runs no model)."""
    server = counters.acceptance
    outlooks = {
        item.request.request_id: states.of(item.request.request_id).acceptance.outlook(
            caps[item.request.request_id], server
        )
        for item in seqs
        if caps.get(item.request.request_id, 0) > 0
    }
    propose = counters.propose_cost
    ks, base_ms = _best_drafts(
        target, seqs, outlooks, lambda ks: propose.predict_ms(max(ks.values()), len(ks)), PLAN_MARGIN
    )
    if base_ms > 0.0:
        row_ms = target.cost.row_ms(len(seqs), 1)
        candidates = [
            Unasked(
                item.request.request_id,
                states.of(item.request.request_id).acceptance.unasked_steps,
                target.cost.extra_ms(1, item.request.num_computed_tokens, row_ms, item.request.grammar is not None),
            )
            for item in seqs
            if item.request.request_id in outlooks and item.request.request_id not in ks
        ]
        trying = explored(candidates, propose.predict_ms(max(caps.values()), 1), target.explore, bool(ks))
        for item in seqs:
            states.of(item.request.request_id).acceptance.exploring = item.request.request_id in trying
        ks.update({rid: caps[rid] for rid in trying})
    # Where a longer proposal costs the draft next to nothing (a lookup, or a fitted cost that says so), the whole cap
    # is asked for: what of it is verified is decided when it comes (`trimmed`), by its drafts' chances or its
    # source's record. The plan's k comes from rates per position, which only steps that asked that far can raise: a
    # lookup asked for 2 by them would never show that its matches run 6 deep.
    longest = propose.predict_ms(max(caps[rid] for rid in ks), len(ks)) if ks else 0.0
    if ks and (lookups or longest - propose.predict_ms(max(ks.values()), len(ks)) <= 0.01 * base_ms):
        ks = {rid: caps[rid] for rid in ks}
    return ks


def trimmed(
    target: WorkerRecord,
    seqs: Sequence[ScheduledSeq],
    proposals: Mapping[str, m.Proposal],
    counters: SpecCounters,
    states: SpecStates,
) -> dict[str, m.Proposal]:
    """Each proposal cut to the length (a tree: the nodes) that pays, now that the wait for it is spent: by its drafts'
    own chances held to their source's record where it gives them, else by its source's rates."""
    server = counters.acceptance
    outlooks: dict[str, list[tuple[float, list[float]]]] = {}
    for item in seqs:
        rid = item.request.request_id
        if (proposal := proposals.get(rid)) is not None:
            acceptance = states.of(rid).acceptance
            if proposal.chances is not None:
                gains = chance_gains(proposal.chances, acceptance.chance_scale(proposal.source, server))
            elif proposal.parents is None:
                gains = expected_accepted(acceptance.rates(proposal.source, len(proposal.token_ids), server))
            else:  # a tree's nodes at one depth are alternatives: each brings its own chance of being accepted
                gains = acceptance.tree_gains(proposal.source, len(proposal.token_ids), server)
            outlooks[rid] = [(1.0, gains)]
    ks, _ = _best_drafts(target, seqs, outlooks, lambda ks: 0.0, 0.0)
    for item in seqs:  # one asked for to try it has a draft token verified at least, or nothing is learned
        if states.of(item.request.request_id).acceptance.exploring and item.request.request_id in proposals:
            ks[item.request.request_id] = max(ks.get(item.request.request_id, 0), 1)
    return {rid: _first_nodes(proposal, ks[rid]) for rid, proposal in proposals.items() if ks.get(rid, 0) > 0}


def _best_drafts(
    target: WorkerRecord,
    seqs: Sequence[ScheduledSeq],
    outlooks: dict[str, list[tuple[float, list[float]]]],
    wait_ms: Callable[[dict[str, int]], float],
    margin: float,
) -> tuple[dict[str, int], float]:
    """k per request (none of 0) that maximises the step's expected tokens per ms, each request's drafts turning out
    as its outlook says ((chance, tokens its first k bring) per source that may answer), and the plain step's
    predicted time; ({}, 0) while the target's step time is not known."""
    shape = step_shape(
        [
            (item.num_tokens, 0, item.request.num_computed_tokens, item.completes and item.request.grammar is not None)
            for item in seqs
        ]
    )
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
    options = [
        DraftOption(
            rid,
            [
                target.cost.extra_ms(n, requests[rid].num_computed_tokens, row_ms, requests[rid].grammar is not None)
                for n in range(longest[rid])
            ],
            outlook,
        )
        for rid, outlook in outlooks.items()
    ]
    return best_drafts(options, base_tokens, base_ms, wait_ms, margin), base_ms


def _first_nodes(proposal: m.Proposal, n: int) -> m.Proposal:
    """The proposal's first n nodes (a tree's: a tree too, since a node's parent comes before it)."""
    if n >= len(proposal.token_ids):
        return proposal
    return msgspec.structs.replace(
        proposal,
        token_ids=proposal.token_ids[:n],
        dists=None if proposal.dists is None else proposal.dists[:n],
        parents=None if proposal.parents is None else proposal.parents[:n],
        chances=None if proposal.chances is None else proposal.chances[:n],
    )
