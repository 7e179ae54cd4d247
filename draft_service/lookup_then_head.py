"""A lookup where it finds something, the EAGLE-style head everywhere else
(`--draft eagle+ngram` and `eagle+phrases`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from draft_service.head_proposer import EagleProposer
from draft_service.prompt_lookup import LookupProposer
from draft_service.proposer import ProposeInput, Proposed


class LookupThenHead:
    """A lookup where it finds something (prompt lookup for `eagle+ngram`; prompt lookup, then
    the target's own phrases for `eagle+phrases`), an EAGLE head everywhere else.

    A small target repeats the prompt and its own phrases often; where it does, a lookup's
    continuation is nearly free and often right for many tokens, so it gets the whole k.
    Where nothing matches, the head proposes up to `head_tokens` (its later tokens are
    accepted rarely, so a longer proposal costs more than it brings). The head skips the
    steps the lookups served and catches up on them from the target's features, which the
    scheduler sends for every position.
    """

    def __init__(self, head: EagleProposer, lookup: LookupProposer, head_tokens: int) -> None:
        self._head, self._lookup, self._head_tokens = head, lookup, head_tokens
        self.vocab_size = head.vocab_size
        self.vocab_fingerprint = head.vocab_fingerprint
        self.target_fingerprint = head.target_fingerprint
        self.feature_width = head.feature_width

    def phases(self) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        load_head, allocate_head, warm_up_head = self._head.phases()
        load_lookup, allocate_lookup, warm_up_lookup = self._lookup.phases()
        return _both(load_head, load_lookup), _both(allocate_head, allocate_lookup), _both(warm_up_head, warm_up_lookup)

    @property
    def num_used_kv_pages(self) -> int:
        return self._head.num_used_kv_pages

    @property
    def num_kv_pages(self) -> int:
        return self._head.num_kv_pages

    @property
    def kernels(self) -> str:
        return self._head.kernels

    def forget(self, request_id: str) -> None:
        self._head.forget(request_id)

    def propose(self, batch: list[ProposeInput]) -> list[Proposed]:
        found = [self._lookup.find(item.token_ids, item.num_tokens) for item in batch]
        rest = [
            replace(item, num_tokens=min(item.num_tokens, self._head_tokens))
            for item, proposed in zip(batch, found)
            if not proposed.token_ids
        ]
        from_head = iter(self._head.propose(rest) if rest else [])
        return [proposed if proposed.token_ids else next(from_head) for proposed in found]


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        first()
        second()

    return run
