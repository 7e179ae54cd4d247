"""What the draft service holds per sequence, and how a propose request moves it forward.

The scheduler keeps the same count on its side: for each sequence, how many tokens the
service holds (its last proposal included). A propose request says how many of those to
drop (rejected proposals) and which tokens to append; if the count it expects is not
what is held, the sequence starts over from nothing and the next request resends it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling.features import FeatureError, from_rows
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
            if rows is None or seq.features.start_position > have or (features is not None and tuple(rows.shape[1:]) != features.row_shape):
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
