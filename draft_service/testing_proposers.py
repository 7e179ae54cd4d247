"""Proposers for tests: the worst and the best a proposer can be. Never for serving.

- `RandomProposer`: tokens drawn from the whole vocabulary; nearly all are rejected. Each
  proposal is a deterministic function of the sequence (a hash seeds it), so its
  distribution is a point mass and sampled verification stays lossless.
- `ReplayProposer`: proposes the continuation of whichever reference sequence (a JSON
  list of token-id lists: prompt plus its known output) starts with the sequence so
  far; nearly all are accepted when the references are the target's own output.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path

from draft_service.proposer import ProposeInput, Proposed, StatelessProposer, nothing


class RandomProposer(StatelessProposer):
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def propose(self, batch: list[ProposeInput]) -> list[Proposed]:
        proposals = []
        for item in batch:
            seed = hashlib.sha256(repr((len(item.token_ids), item.token_ids[-8:])).encode()).digest()
            rng = random.Random(seed)
            proposals.append(Proposed([rng.randrange(self.vocab_size) for _ in range(item.num_tokens)]))
        return proposals


class ReplayProposer(StatelessProposer):
    def __init__(self, path: Path) -> None:
        self._path = path
        self._references: list[list[int]] = []

    def phases(self) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        return self._load, nothing, nothing

    def _load(self) -> None:
        references = json.loads(self._path.read_text())
        if not isinstance(references, list) or not all(
            isinstance(r, list) and all(isinstance(t, int) for t in r) for r in references
        ):
            raise ValueError(f"{self._path}: expected a JSON list of token-id lists")
        self._references = references

    def propose(self, batch: list[ProposeInput]) -> list[Proposed]:
        proposals = []
        for item in batch:
            n = len(item.token_ids)
            match = next((r for r in self._references if len(r) > n and r[:n] == item.token_ids), None)
            proposals.append(Proposed(match[n : n + item.num_tokens] if match else []))
        return proposals
