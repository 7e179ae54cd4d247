"""The token masks of requests whose completion follows a grammar (common/text/structured.py), on a target worker.

Every step of such a request names its grammar and carries the sequence's tokens (the
worker keeps none). The worker keeps one llguidance matcher per request as a cache: it is
brought to the state after the completion tokens before the step, from its last state
when those extend what it consumed, else from the start (another worker ran the request
before, or the scheduler cut the tokens). A sampling row's mask is the grammar's after
the row's own prefix: the tokens that stand, then its draft branch; so a verify row is
masked exactly as the decode step it stands for, and verification stays lossless. A row
after a draft token the grammar does not allow is left unmasked: that token is never
accepted, so the row is never used. After the step the matcher consumes the tokens that
came out, and says which tokens the grammar forces next (the scheduler proposes them as
draft tokens) and whether it is complete: once it allows nothing more, end-of-sequence is
the one token allowed, and the grammar is complete when that came (a grammar's request
always stops there, ignore_eos or not, so nothing after it stands).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import llguidance
import torch

from common.trees import branch_to, parents_or_chain
from proto.messages import SeqWork


class GrammarFailure(RuntimeError):
    """The request's tokens do not follow its grammar, or the grammar cannot be used (the request's own fault)."""


@dataclass
class _Matcher:
    grammar: str
    matcher: llguidance.LLMatcher
    consumed: list[int] = field(default_factory=list)


class GrammarMasks:
    def __init__(self, tokenizer: Callable[[], llguidance.LLTokenizer], vocab_size: int, max_requests: int) -> None:
        self._make_tokenizer = tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on the first grammar (it takes ~0.5 s)
        self._vocab_size = vocab_size
        self._max_requests = max_requests
        self._matchers: OrderedDict[str, _Matcher] = OrderedDict()  # least recently used first
        self._shifts = torch.arange(8, dtype=torch.uint8)

    def row_masks(self, w: SeqWork) -> list[torch.Tensor | None]:
        """Which tokens each sampling row of the sequence allows (bool `[V]`); None: the row is never used."""
        assert w.grammar is not None and w.history is not None
        num_standing = len(w.token_ids) - w.num_draft_tokens
        state = self._matcher(w.request_id, w.grammar, [*w.history, *w.token_ids[:num_standing]][w.num_prompt_tokens :])
        masks: list[torch.Tensor | None] = [self._mask(state.matcher)]
        drafts = w.token_ids[num_standing:]
        parents = parents_or_chain(w.draft_parents, len(drafts))
        for node in range(len(drafts)):
            branch = [drafts[n] for n in branch_to(parents, node)]
            followed, consumed, _ = self._follow(state.matcher, branch)
            masks.append(self._mask(state.matcher) if followed == len(branch) else None)
            state.matcher.rollback(consumed)
        return masks

    def after_step(self, request_id: str, token_ids: Sequence[int]) -> tuple[list[int], bool]:
        """Consume the step's new tokens; returns the tokens the grammar forces next and whether it is complete."""
        state = self._matchers[request_id]
        followed, _, ended = self._follow(state.matcher, token_ids)
        if ended:  # what follows end-of-sequence is cut by the scheduler (it stops a grammar's request)
            return [], True
        if followed < len(token_ids):
            raise GrammarFailure(f"the tokens sampled do not follow the grammar: {state.matcher.get_error()}")
        state.consumed.extend(token_ids)
        return ([] if state.matcher.is_stopped() else state.matcher.compute_ff_tokens()), False

    def _follow(self, matcher: llguidance.LLMatcher, tokens: Sequence[int]) -> tuple[int, int, bool]:
        """Consume tokens while the grammar allows them. An end-of-sequence token once the grammar allows nothing more
        ends it (the matcher takes no token then). Returns how many were followed, how many the matcher consumed
        (to roll back), and whether the grammar ended."""
        followed = consumed = 0
        ended = False
        for token in tokens:
            if ended:
                break
            if matcher.is_stopped():
                if token not in self.tokenizer.eos_tokens:
                    break
                ended = True
            elif matcher.try_consume_tokens([token]) == 1:
                consumed += 1
            else:
                break
            followed += 1
        return followed, consumed, ended

    def _matcher(self, request_id: str, grammar: str, completion: list[int]) -> _Matcher:
        state = self._matchers.pop(request_id, None)
        if state is None or state.grammar != grammar or completion[: len(state.consumed)] != state.consumed:
            state = _Matcher(grammar, llguidance.LLMatcher(self.tokenizer, grammar))
            if state.matcher.is_error():
                raise GrammarFailure(f"the grammar cannot be used: {state.matcher.get_error()}")
        rest = completion[len(state.consumed) :]
        followed, _, _ = self._follow(state.matcher, rest)
        if followed < len(rest):
            raise GrammarFailure(f"the completion does not follow its grammar: {state.matcher.get_error()}")
        state.consumed = list(completion)
        self._matchers[request_id] = state
        while len(self._matchers) > self._max_requests:
            self._matchers.popitem(last=False)
        return state

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = self._make_tokenizer()
        return self._tokenizer

    def _mask(self, matcher: llguidance.LLMatcher) -> torch.Tensor:
        if matcher.is_error():
            raise GrammarFailure(f"the grammar failed: {matcher.get_error()}")
        bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        return ((bits.unsqueeze(1) >> self._shifts) & 1).flatten()[: self._vocab_size].bool()
