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


class SequenceStore:
    """Tokens per sequence; and, for a draft that reads them, the target features it was sent (kept until forgotten)."""

    def __init__(self) -> None:
        self._held: dict[str, list[int]] = {}  # the sequence as known, then its last proposal
        self._features: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._held)

    def update(self, seq: ProposeSeq) -> Update:
        held = self._held.get(seq.request_id, [])
        features = self._features.get(seq.request_id)
        if seq.num_held != len(held) or seq.num_drop > len(held):
            self.forget(seq.request_id)
            return Update([], 0, restarted=True)
        if seq.features is not None:
            have = 0 if features is None else features.shape[0]
            try:
                rows = from_rows(seq.features)
            except FeatureError:
                rows = None
            if rows is None or seq.features.start_position > have or (features is not None and rows.shape[1:] != features.shape[1:]):
                self.forget(seq.request_id)  # rows that do not fit what is held: start over, the scheduler resends
                return Update([], 0, restarted=True)
            start = seq.features.start_position
            features = rows if features is None or start == 0 else torch.cat((features[:start], rows.to(features.dtype)))
            self._features[seq.request_id] = features
        num_stable = len(held) - seq.num_drop
        tokens = held[:num_stable] + list(seq.new_token_ids)
        self._held[seq.request_id] = tokens
        return Update(list(tokens), num_stable, restarted=False, features=features)

    def record_proposal(self, request_id: str, token_ids: list[int]) -> None:
        self._held[request_id].extend(token_ids)

    def forget(self, request_id: str) -> bool:
        self._features.pop(request_id, None)
        return self._held.pop(request_id, None) is not None
