"""Whether a planned step speculates, and how many draft tokens (k) each of its decoding sequences may get.

The rule (`--speculation-policy goodput`, the default) maximises the step's expected tokens
per second:

    (tokens the step makes without drafts + sum of each sequence's expected accepted drafts)
    / (predicted step time with those drafts' rows + the wait for the proposals)

from what was measured where it runs: the target's step time (cost.py, fitted to its steps),
the wait for a proposal (the same kind of fit, to what each step that waited for one kept
its target idle beyond a plain step: counters.py `stepped`), and how often each position of
a draft is accepted, per request and per source (acceptance.py). It is decided twice: when the step is
planned, k per sequence from each request's record over all sources, which may be 0 for all
(then no proposal is asked, and the step runs at once); and when the proposals come, each is
cut to the length (a tree: the number of nodes) that pays, by its source's record, now that
the wait for it is spent (`trim`). Both solve the ratio by Dinkelbach's method: for a rate
λ, each sequence's k maximises gain(k) - λ * time(k) on its own; λ becomes the ratio those
k give; it stops when the ratio stops rising, and keeps the best answer, plain decoding
included. At plan time a step asks for proposals only where that is expected to beat plain
decoding by PLAN_MARGIN: the chance that the draft finds anything, its rates and the wait
are each estimates, and a step that asks for a gain within their error loses as often as
it wins (prompt lookup on code at c = 4 asked in 90% of the steps for an expected gain of
a few percent, and ran at 0.91x of plain decoding). A proposal in hand is verified if it
pays at all.

The estimates are means, so what they say no to is never tried again by them. Trying is
apart and bounded (`ExploreBudget`, `explored`): while the target's explore budget
(EXPLORE_SHARE of its step time) holds, a new request is asked for at its first decode
step, and the others by turns, at least one draft token of each verified. Where drafts
never pay, that share is what speculation costs.

Caps, not the decision: `--num-speculative-tokens` (and the target's and the draft's
limits), `--spec-disable-batch-threshold` (a step of more sequences never speculates),
`--spec-draft-token-budget` (the draft tokens of one step, shared evenly), the step's token
budget, max_tokens and the context.

`--speculation-policy fixed` speculates up to the caps in every step the threshold allows
(for comparison, and for tests that need every step to speculate).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from scheduler.batching import ScheduledSeq

_MAX_ROUNDS = 6  # Dinkelbach rounds at most (it settles in two or three)
PLAN_MARGIN = 0.05  # what asking for proposals must be expected to gain over plain decoding, as a share of its rate
EXPLORE_SHARE = 0.01  # of a target's step time, what asks its estimates do not call for may take
_EXPLORE_HOLD_MS = 1500.0  # the explore budget holds at most this much step time's earnings


@dataclass(frozen=True)
class SpecLimits:
    num_speculative_tokens: int  # k at most (the smallest of the scheduler's, the target's and the draft's)
    spec_disable_batch_threshold: int
    spec_draft_token_budget: int  # draft tokens one step verifies in all, shared evenly among its decoding sequences
    max_num_batched_tokens: int
    max_model_len: int


def draft_caps(seqs: Sequence[ScheduledSeq], limits: SpecLimits) -> dict[str, int]:
    """The most draft tokens each decoding sequence of a planned step may get (none of 0); empty: none may."""
    if limits.num_speculative_tokens < 1 or len(seqs) > limits.spec_disable_batch_threshold:
        return {}
    decodes = [item for item in seqs if item.completes and item.num_tokens == 1]
    if not decodes:
        return {}
    spare = limits.max_num_batched_tokens - sum(item.num_tokens for item in seqs)
    k_max = min(limits.num_speculative_tokens, spare // len(decodes), limits.spec_draft_token_budget // len(decodes))
    caps: dict[str, int] = {}
    for item in decodes:
        r = item.request
        # Every new token (the accepted drafts plus one) must fit in max_tokens and the context.
        k = min(k_max, r.max_tokens - len(r.output_token_ids) - 1, limits.max_model_len - r.num_tokens - 1)
        if k >= 1:
            caps[r.request_id] = k
    return caps


@dataclass(frozen=True)
class DraftOption:
    """One sequence's choice: extra_ms[k], what k draft rows add to the step; and per way its proposal may turn out
    (which source answers), the chance of it and gains[k], the tokens k of its drafts are expected to bring
    (gains[0] = 0). The chances may sum to less than 1: the draft may find nothing."""

    key: str
    extra_ms: Sequence[float]
    outcomes: Sequence[tuple[float, Sequence[float]]]

    @classmethod
    def certain(cls, key: str, gains: Sequence[float], extra_ms: Sequence[float]) -> DraftOption:
        """A proposal in hand: one outcome."""
        return cls(key, extra_ms, [(1.0, gains)])


def best_drafts(
    options: Sequence[DraftOption],
    base_tokens: float,
    base_ms: float,
    wait_ms: Callable[[dict[str, int]], float],
    margin: float = 0.0,
) -> dict[str, int]:
    """k per key (only k > 0) that maximises the expected (base_tokens + gains) / (base_ms + extra_ms + wait_ms(ks),
    the wait only where some k > 0), each outcome of an option taking its own best k, the largest of which the key
    gets; empty: plain decoding is best, or the best beats it by no more than `margin` (a share of its rate)."""
    if base_ms <= 0.0 or not options:
        return {}
    best: dict[str, int] = {}
    best_rate = base_tokens / base_ms * (1.0 + margin)
    rate = best_rate
    for _ in range(_MAX_ROUNDS):
        ks: dict[str, int] = {}
        tokens, ms = base_tokens, base_ms
        for option in options:
            value = gained = spent = 0.0
            largest = 0
            for chance, gains in option.outcomes:
                k = max(range(len(gains)), key=lambda n: gains[n] - rate * option.extra_ms[n])
                value += chance * (gains[k] - rate * option.extra_ms[k])
                gained += chance * gains[k]
                spent += chance * option.extra_ms[k]
                largest = max(largest, k)
            if value > 0.0 and largest > 0:
                ks[option.key] = largest
                tokens += gained
                ms += spent
        if not ks:
            break
        ms += wait_ms(ks)
        if tokens / ms <= rate * (1 + 1e-9):
            break
        rate = tokens / ms
        if rate > best_rate:
            best, best_rate = ks, rate
    return best


def beyond_reach(
    outlooks: Iterable[Sequence[tuple[float, Sequence[float]]]], rate: float, row_ms: float, wait_ms: float
) -> bool:
    """Whether no k of these sequences' can make a step beat `rate` (tokens per ms), so that `best_drafts` would find
    nothing: a way a proposal may turn out (chance, gains) brings at most its largest gain of one more draft per row,
    each row costs at least `row_ms`, and an ask waits at least `wait_ms`. A shortcut with the same answer, for the
    steps (most, where drafts do not pay) that would otherwise price every k of every sequence."""
    most = 0.0
    for outlook in outlooks:
        for chance, gains in outlook:
            step = max((after - before for before, after in zip(gains, gains[1:])), default=0.0)
            most += chance * (len(gains) - 1) * max(0.0, step - rate * row_ms)
    return most <= rate * wait_ms


class ExploreBudget:
    """What a target may spend on asks for proposals that its estimates do not call for.

    The estimates are means: a request whose drafts stopped paying is not asked again by
    them, and whether its drafts pay again (the copying part of an answer, after a part of
    its own) shows only if it is asked; nor do they ask for a new request that the server's
    record says no to (an editing request after a run of chat). So it earns EXPLORE_SHARE
    of each of the target's steps, holds at most _EXPLORE_HOLD_MS of steps' earnings (it
    starts full), and pays what such asks cost: the wait for the answer, where the step
    would not have waited, and a draft row of each request asked (`explored`)."""

    def __init__(self) -> None:
        self.balance_ms = EXPLORE_SHARE * _EXPLORE_HOLD_MS

    def earn(self, step_ms: float) -> None:
        if step_ms > 0.0:
            self.balance_ms = min(EXPLORE_SHARE * _EXPLORE_HOLD_MS, self.balance_ms + EXPLORE_SHARE * step_ms)


@dataclass(frozen=True)
class Unasked:
    """A request the step's estimates did not ask for: how many of its decode steps went by since its last ask (inf:
    never asked), and what one draft row of it costs the step."""

    key: str
    steps_since_ask: float
    row_ms: float


def explored(candidates: Sequence[Unasked], wait_ms: float, budget: ExploreBudget, asking: bool) -> list[str]:
    """Of the requests a step's estimates did not ask for, the ones asked for anyway, the budget charged: those never
    asked first, then the longest unasked, each while the budget holds a draft row of it and the wait (unless the step
    is `asking` already, or one before it pays that). A request asked before must leave the budget what one never
    asked would need, so that a new request is learned at once."""
    chosen: list[str] = []
    for candidate in sorted(candidates, key=lambda c: -c.steps_since_ask):
        if candidate.steps_since_ask < 1:
            break
        cost = candidate.row_ms + (0.0 if asking or chosen else wait_ms)
        reserve = 0.0 if math.isinf(candidate.steps_since_ask) else wait_ms + candidate.row_ms
        if budget.balance_ms < cost + reserve:
            break
        budget.balance_ms -= cost
        chosen.append(candidate.key)
    return chosen
