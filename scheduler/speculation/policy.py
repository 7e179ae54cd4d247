"""Whether a planned step speculates, and how many draft tokens (k) each of its decoding sequences may get.

A step speculates when it has at most `spec_disable_batch_threshold` sequences; then every
sequence that is decoding gets k draft tokens, fewer when its max_tokens, the context or
the step's token budget leave less room, and at most `spec_draft_token_budget` draft
tokens in all, shared evenly (so k shrinks as the batch grows: 6 at up to 5 sequences with
the default 32, 4 at 8, 2 at 16). Larger steps decode plainly: there the target is busy
enough that verifying rejected tokens costs more than it saves; and on a CPU every
verified token costs compute, so the more sequences, the fewer guesses each may make
(docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.batching import ScheduledSeq


@dataclass(frozen=True)
class SpecLimits:
    num_speculative_tokens: int  # k at most (the smallest of the scheduler's, the target's and the draft's)
    spec_disable_batch_threshold: int
    spec_draft_token_budget: int  # draft tokens one step verifies in all, shared evenly among its decoding sequences
    max_num_batched_tokens: int
    max_model_len: int


def speculation_plan(seqs: Sequence[ScheduledSeq], limits: SpecLimits) -> dict[str, int]:
    """k per request id for the decoding sequences of a planned step; empty: decode plainly."""
    if limits.num_speculative_tokens < 1 or len(seqs) > limits.spec_disable_batch_threshold:
        return {}
    decodes = [item for item in seqs if item.completes and item.num_tokens == 1]
    if not decodes:
        return {}
    spare = limits.max_num_batched_tokens - sum(item.num_tokens for item in seqs)
    k_max = min(limits.num_speculative_tokens, spare // len(decodes), limits.spec_draft_token_budget // len(decodes))
    ks: dict[str, int] = {}
    for item in decodes:
        r = item.request
        # Every new token (the accepted drafts plus one) must fit in max_tokens and the context.
        k = min(k_max, r.max_tokens - len(r.output_token_ids) - 1, limits.max_model_len - r.num_tokens - 1)
        if k >= 1:
            ks[r.request_id] = k
    return ks
