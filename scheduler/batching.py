"""Continuous batching as a pure function: which sequences of a worker run in its next step, and how many tokens each.

One rule covers prefill, chunked prefill and decode: each sequence's computed tokens
catch up with its tokens. Sequences that only need one token (decode) go first, so a
long prompt never stalls the running batch; prompts fill the rest of the token budget,
chunked when they do not fit.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.request import Request


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


def plan_step(running: list[Request], limits: BatchLimits) -> list[ScheduledSeq]:
    """`running` in placement order; returns the step's sequences, decodes first."""
    decodes = [r for r in running if r.num_uncomputed_tokens == 1]
    prefills = [r for r in running if r.num_uncomputed_tokens > 1]
    plan: list[ScheduledSeq] = []
    budget = limits.max_num_batched_tokens
    for request in decodes + prefills:
        if budget == 0 or len(plan) == limits.max_num_seqs:
            break
        num_tokens = min(request.num_uncomputed_tokens, budget)
        plan.append(ScheduledSeq(request, num_tokens))
        budget -= num_tokens
    return plan
