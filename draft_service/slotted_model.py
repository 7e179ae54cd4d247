"""What every proposer that runs a model shares: its engine's phases, KV pages per sequence, the warm-up, the draw.

`SlottedModelProposer` is the base of the draft model (`draft_service.model_proposer`) and
the EAGLE-style head (`draft_service.head_proposer`); `draw` picks the draft's token from
its logits, greedy or sampled on a stream of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import torch

from draft_service.proposer import ProposeInput, Proposer
from draft_service.sequences import SequencePages
from modeling.sampling.draw import generator_for, is_greedy, target_probs
from proto.messages import SamplingParams, SparseDist

# The draft's draws use their own stream, apart from the target's draws at the same positions.
_DRAFT_STREAM = 0x2545F4914F6CDD1D


def warm_up_sequences(proposer: Proposer, num_slots: int, k: int, feature_width: int = 0) -> None:
    """A proposal for `num_slots` sequences at once at the longest k, greedy and sampled; then they are forgotten."""
    prompt = [(11 * i + 5) % proposer.vocab_size for i in range(8)]
    features = None
    if feature_width:
        features = torch.randn(len(prompt) - 1, feature_width, generator=torch.Generator().manual_seed(0))
    batch = [
        ProposeInput(f"warm-up-{i}", prompt, 0, k, SamplingParams(temperature=float(i % 2), seed=i), features)
        for i in range(num_slots)
    ]
    if any(len(p.token_ids) != k for p in proposer.propose(batch)):
        raise RuntimeError(f"warm-up: the {type(proposer).__name__} did not propose k tokens for every sequence")
    for item in batch:
        proposer.forget(item.request_id)


class _Engine(Protocol):
    def load(self) -> None: ...
    def allocate(self) -> None: ...
    @property
    def ops(self) -> str: ...


EngineT = TypeVar("EngineT", bound=_Engine)


class SlottedModelProposer(Generic[EngineT]):
    """What a proposer running a model does: load and allocate its engine, warm up, pages per sequence."""

    _engine: EngineT
    _pages: SequencePages

    def phases(self) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        return self._engine.load, self._engine.allocate, self._warm_up

    @property
    def num_used_kv_pages(self) -> int:
        return self._pages.pool.num_pages - self._pages.pool.num_available

    @property
    def num_kv_pages(self) -> int:
        return self._pages.pool.num_pages

    @property
    def kernels(self) -> str:
        return self._engine.ops

    def _warm_up(self) -> None:
        raise NotImplementedError


def draw(
    logits: torch.Tensor,
    params: SamplingParams,
    position: int,
    dists: list[SparseDist],
    top_k: int,
    token_ids: torch.Tensor | None,
) -> int:
    """The draft's token from its logits: the argmax when greedy, else a draw from its `top_k` most likely (the
    distribution drawn from is appended to `dists`).
    `token_ids` maps logit columns to vocabulary ids (None: the same)."""
    if is_greedy(params):
        column = int(torch.argmax(logits))
        return column if token_ids is None else int(token_ids[column])
    probs = target_probs(logits, params)
    kept = torch.topk(probs, min(top_k, probs.shape[-1]))
    support = kept.values > 0
    values, columns = kept.values[support], kept.indices[support]
    ids = columns if token_ids is None else token_ids[columns]
    q = values / values.sum()
    generator = generator_for(params.seed ^ _DRAFT_STREAM, position, probs.device)
    choice = int(torch.multinomial(q, 1, generator=generator))
    dists.append(SparseDist(ids.tolist(), q.tolist()))
    return int(ids[choice])
