"""Continuous batching: which sequences of a worker run in its next step, how many tokens each, and how many drafts.

One rule covers prefill, chunked prefill and decode: each sequence's computed tokens
catch up with its tokens. Sequences that only need one token (decode) go first, so a
long prompt never stalls the running batch; prompts fill the rest of the token budget,
chunked when they do not fit. The plan is frozen: what the scheduler decided for one
step, from which the propose request and the step itself are built.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from scheduler.requests import Request


@dataclass(frozen=True)
class BatchLimits:
    max_num_batched_tokens: int  # new tokens in one step, all sequences together
    max_num_seqs: int  # sequences in one step


@dataclass(frozen=True)
class ScheduledSeq:
    request: Request
    num_tokens: int  # new tokens this step computes for it

    @property
    def completes(self) -> bool:
        """After this step the sequence is fully computed, so a token is sampled."""
        return self.num_tokens == self.request.num_uncomputed_tokens


@dataclass(frozen=True)
class StepPlan:
    """One step of one worker: its sequences (decodes first), and the draft tokens it waits for."""

    seqs: tuple[ScheduledSeq, ...]
    # k asked of the draft service per request id; empty: the step runs at once, without proposals.
    num_draft_tokens: Mapping[str, int] = field(default_factory=dict)

    @property
    def waits_for_proposals(self) -> bool:
        return bool(self.num_draft_tokens)


def select_seqs(running: Sequence[Request], limits: BatchLimits) -> list[ScheduledSeq]:
    """`running` in placement order; returns the step's sequences, decodes first."""
    decodes = [r for r in running if r.num_uncomputed_tokens == 1]
    prefills = [r for r in running if r.num_uncomputed_tokens > 1]
    seqs: list[ScheduledSeq] = []
    budget = limits.max_num_batched_tokens
    for request in decodes + prefills:
        if budget == 0 or len(seqs) == limits.max_num_seqs:
            break
        num_tokens = min(request.num_uncomputed_tokens, budget)
        seqs.append(ScheduledSeq(request, num_tokens))
        budget -= num_tokens
    return seqs


def plan_step(
    running: Sequence[Request], limits: BatchLimits, draft_tokens: Callable[[list[ScheduledSeq]], Mapping[str, int]]
) -> StepPlan | None:
    """The next step of a worker running `running`, or None when none of them needs one.

    `draft_tokens` is the speculation decision for the chosen sequences (k per request id).
    """
    seqs = select_seqs(running, limits)
    if not seqs:
        return None
    return StepPlan(tuple(seqs), dict(draft_tokens(seqs)))


@dataclass(frozen=True)
class StepSeq:
    """One sequence of a step sent to a worker, as the scheduler must remember it until the result comes."""

    request: Request
    num_tokens: int  # tokens of the sequence itself the step computes (draft tokens not counted)
    samples: bool
    draft_token_ids: list[int]  # the proposal it verifies; empty without one
    draft_generation: int = 0  # the request's DraftView generation when the proposal was made
    draft_parents: list[int] | None = None  # the proposal's token tree (common.trees); None: a chain
    prompt_scores: int | None = None  # prompt log-probabilities the step returns for it; None: none asked for
    computed_before: int = 0  # positions of it computed before the step (what its rows attend to besides their own)
    draft_source: str = ""  # the proposer that made its drafts (acceptance.GRAMMAR: its grammar forced them)
    draft_chances: list[float] | None = None  # the proposer's chance of each draft being accepted; None: unsaid


@dataclass
class InFlightStep:
    step_id: int
    sent_at_s: float
    seqs: list[StepSeq]  # in step order
    planned_at_s: float  # when it was planned: for a step that waited for proposals, when they were asked for
    asked: tuple[int, int] | None = None  # it waited for proposals: (the largest k, the sequences) asked for
