"""Drafts a grammar forces: the tokens a decoding request's grammar allows alone next, verified as the step's drafts
(source acceptance.GRAMMAR) without asking the draft service, and certain to be accepted whatever the batch size."""

from __future__ import annotations

from common.defaults import NUM_SPECULATIVE_TOKENS
from scheduler.batching import ScheduledSeq
from scheduler.config import SchedulerConfig


def forced_drafts(item: ScheduledSeq, max_draft_tokens: int, config: SchedulerConfig) -> list[int]:
    """The tokens the request's grammar forces next, as many as the step may verify: `--num-speculative-tokens` at
    most (0 turns these off too), the target's `max_draft_tokens`, what max_tokens and the context leave; none unless
    the step completes the sequence with one new token (a decode)."""
    r = item.request
    if not r.forced_token_ids or not item.completes or item.num_tokens != 1:
        return []
    k = min(
        config.num_speculative_tokens if config.num_speculative_tokens is not None else NUM_SPECULATIVE_TOKENS,
        max_draft_tokens,
        r.max_tokens - len(r.output_token_ids) - 1,
        config.max_model_len - r.num_tokens - 1,
    )
    return r.forced_token_ids[: max(k, 0)]
