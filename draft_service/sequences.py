"""What the draft service holds per sequence, and how a propose request moves it forward.

The scheduler keeps the same count on its side: for each sequence, how many tokens the
service holds (its last proposal included). A propose request says how many of those to
drop (rejected proposals) and which tokens to append; if the count it expects is not
what is held, the sequence starts over from nothing and the next request resends it.
A draft that runs a model keeps each sequence's keys and values in pages of its own
(`SequencePages`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling.model.features import FeatureError, from_rows
from modeling.model.kv_cache import pages_for
from common.page_pool import PagePool
from proto.messages import ProposeSeq


@dataclass(frozen=True)
class Update:
    token_ids: list[int]  # the sequence after the update (no proposal)
    num_stable: int  # leading tokens unchanged since the previous proposal
    restarted: bool  # the counts disagreed: nothing was held
    features: torch.Tensor | None = None  # target features of positions 0 .. rows-1, when the scheduler sends them


class FeatureBuffer:
    """A sequence's target features, rows 0 .. length-1, in storage that grows by doubling.

    Writing rows at `start` cuts the buffer back to `start` first (rows past it stood for
    rejected tokens), and copies only the new rows, so a generation's feature updates cost
    linear, not quadratic, time.
    """

    def __init__(self, rows: torch.Tensor) -> None:
        self._data = rows.clone()
        self.length = rows.shape[0]

    @property
    def row_shape(self) -> tuple[int, ...]:
        return tuple(self._data.shape[1:])

    def put(self, start: int, rows: torch.Tensor) -> None:
        end = start + rows.shape[0]
        if end > self._data.shape[0]:
            grown = self._data.new_empty((max(end, 2 * self._data.shape[0]), *self._data.shape[1:]))
            grown[:start] = self._data[:start]
            self._data = grown
        self._data[start:end] = rows.to(self._data.dtype)
        self.length = end

    def view(self) -> torch.Tensor:
        """Rows 0 .. length-1, a view: a later `put` may change it (read it before the next update)."""
        return self._data[: self.length]


class SequenceStore:
    """Tokens per sequence; and, for a draft that reads them, the target features it was sent (kept until forgotten)."""

    def __init__(self) -> None:
        self._held: dict[str, list[int]] = {}  # the sequence as known, then its last proposal
        self._features: dict[str, FeatureBuffer] = {}

    def __len__(self) -> int:
        return len(self._held)

    def update(self, seq: ProposeSeq) -> Update:
        held = self._held.get(seq.request_id, [])
        features = self._features.get(seq.request_id)
        if seq.num_held != len(held) or seq.num_drop > len(held):
            self.forget(seq.request_id)
            return Update([], 0, restarted=True)
        if seq.features is not None:
            have = 0 if features is None else features.length
            try:
                rows = from_rows(seq.features)
            except FeatureError:
                rows = None
            if (
                rows is None
                or seq.features.start_position > have
                or (features is not None and tuple(rows.shape[1:]) != features.row_shape)
            ):
                self.forget(seq.request_id)  # rows that do not fit what is held: start over, the scheduler resends
                return Update([], 0, restarted=True)
            start = seq.features.start_position
            if features is None or start == 0:
                features = FeatureBuffer(rows)
                self._features[seq.request_id] = features
            else:
                features.put(start, rows)
        num_stable = len(held) - seq.num_drop
        tokens = held[:num_stable] + list(seq.new_token_ids)
        self._held[seq.request_id] = tokens
        return Update(list(tokens), num_stable, restarted=False, features=None if features is None else features.view())

    def record_proposal(self, request_id: str, token_ids: list[int]) -> None:
        self._held[request_id].extend(token_ids)

    def forget(self, request_id: str) -> bool:
        self._features.pop(request_id, None)
        return self._held.pop(request_id, None) is not None


class SequencePages:
    """The draft's own paged KV cache: each sequence holds pages as it grows (up to `max_seqs` sequences),
    cut back when its tokens are dropped and given back when it is forgotten."""

    def __init__(self, max_seqs: int, max_len: int, page_size: int) -> None:
        self.pool = PagePool(max_seqs * pages_for(max_len, page_size), page_size)
        self._max_seqs = max_seqs
        self._lengths: dict[str, int] = {}  # positions whose keys and values each sequence's pages hold

    def __len__(self) -> int:
        return len(self._lengths)

    def length(self, request_id: str) -> int:
        return self._lengths.get(request_id, 0)

    def reserve(self, request_id: str, num_tokens: int) -> tuple[int, ...] | None:
        """The sequence's block table with room for `num_tokens` positions; None (holding nothing new) when full."""
        if request_id not in self._lengths:
            if len(self._lengths) >= self._max_seqs:
                return None
            self.pool.admit(request_id, [])
            self._lengths[request_id] = 0
        self.pool.truncate(request_id, min(num_tokens, self._lengths[request_id]))  # pages of dropped tokens go back
        if not self.pool.grow(request_id, num_tokens):
            return None
        return tuple(self.pool.block_table(request_id))

    def set_length(self, request_id: str, length: int) -> None:
        """Its pages hold `length` positions now."""
        self._lengths[request_id] = length

    def release(self, request_id: str) -> bool:
        if self._lengths.pop(request_id, None) is None:
            return False
        self.pool.release(request_id)
        return True
