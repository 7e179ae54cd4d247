"""What the draft service holds per sequence, and how a propose request moves it forward.

The scheduler keeps the same count on its side: for each sequence, how many tokens the
service holds (its last proposal included). A propose request says how many of those to
drop (rejected proposals) and which tokens to append; if the count it expects is not
what is held, the sequence starts over from nothing and the next request resends it.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.messages import ProposeSeq


@dataclass(frozen=True)
class Update:
    token_ids: list[int]  # the sequence after the update (no proposal)
    num_stable: int  # leading tokens unchanged since the previous proposal
    restarted: bool  # the counts disagreed: nothing was held


class SequenceStore:
    def __init__(self) -> None:
        self._held: dict[str, list[int]] = {}  # the sequence as known, then its last proposal

    def __len__(self) -> int:
        return len(self._held)

    def update(self, seq: ProposeSeq) -> Update:
        held = self._held.get(seq.request_id, [])
        if seq.num_held != len(held) or seq.num_drop > len(held):
            self._held.pop(seq.request_id, None)
            return Update([], 0, restarted=True)
        num_stable = len(held) - seq.num_drop
        tokens = held[:num_stable] + list(seq.new_token_ids)
        self._held[seq.request_id] = tokens
        return Update(list(tokens), num_stable, restarted=False)

    def record_proposal(self, request_id: str, token_ids: list[int]) -> None:
        self._held[request_id].extend(token_ids)

    def forget(self, request_id: str) -> bool:
        return self._held.pop(request_id, None) is not None
