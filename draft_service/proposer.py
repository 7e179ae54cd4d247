"""The proposer interface: what the draft service gives a proposer, what it answers, and the base of stateless ones.

A proposer, given whole sequences, proposes up to k continuation tokens each. The kinds users run:

- `NgramProposer` (`draft_service.prompt_lookup`): prompt lookup. The continuation of the
  latest earlier occurrence of the sequence's last n tokens, for n from `ngram_max` down to
  `ngram_min`. A proposal is a deterministic function of the sequence, so its distribution
  is a point mass.
- `ModelProposer` (`draft_service.model_proposer`): a small Llama-family draft model run by
  the target's model code, with KV pages per sequence that follow the sequence (cut back
  when tokens are dropped). Greedy requests get its argmax; sampled ones a token drawn from
  its truncated distribution, which is sent along (sparse) for lossless verification.
- `EagleProposer` (`draft_service.head_proposer`): an EAGLE-style head trained for one target
  (`specserve distill`), reading the target's own final hidden states, which the scheduler
  forwards with the tokens; it proposes among its draft vocabulary, mapped back to the
  target's ids.
- `PhraseProposer` (`draft_service.phrase_proposer`): prompt lookup, then the target's own
  phrases, kept in a draft folder by `specserve distill` (`common.text.phrases`): what most often
  followed the longest match of the sequence's last tokens in the target's answers (after a
  match of 1 or 2 tokens, only as many). A point mass too.
- `LookupThenHead` (`draft_service.lookup_then_head`): a lookup (prompt lookup, or prompt
  lookup then phrases: a `LookupProposer`) where it finds something, the head everywhere else.

Proposers for tests live in `draft_service.testing_proposers`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from proto.messages import SamplingParams, SparseDist


@dataclass(frozen=True)
class ProposeInput:
    request_id: str
    token_ids: list[int]  # the whole sequence so far: prompt, then every accepted token
    num_stable: int  # the first num_stable tokens are unchanged since this sequence's previous proposal
    num_tokens: int  # k: propose at most this many
    sampling: SamplingParams
    # For a proposer that reads target features: `[rows, width]`, the target's final hidden
    # state at positions 0 .. rows-1 (every position but the last when complete).
    features: torch.Tensor | None = None
    tenant: str = ""  # whose text a proposer that learns from traffic drafts from (m.ProposeSeq.tenant)


@dataclass(frozen=True)
class Proposed:
    token_ids: list[int]  # possibly empty
    dists: list[SparseDist] | None = None  # per token, what it was drawn from; None = a point mass
    parents: list[int] | None = None  # a token tree (common.trees; point masses only); None = a chain
    source: str = ""  # which proposer made it: "lookup", "phrases", "suffix", "head", "model" (m.Proposal.source)
    chances: list[float] | None = None  # per token, its chance of being accepted, by the proposer; None: unsaid


class Proposer(Protocol):
    vocab_size: int  # 0: works on any vocabulary
    vocab_fingerprint: str  # "": works on any vocabulary
    feature_width: int  # 0: reads no target features
    target_fingerprint: str  # "": serves any target

    def phases(self) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        """The work of LOADING, ALLOCATING and WARMING."""
        ...

    def propose(self, batch: list[ProposeInput]) -> list[Proposed]: ...

    def forget(self, request_id: str) -> None:
        """Drop anything held for the sequence (its draft KV pages)."""
        ...

    @property
    def num_used_kv_pages(self) -> int: ...

    @property
    def num_kv_pages(self) -> int: ...

    @property
    def kernels(self) -> str:
        """Which kernels its model runs on, once loaded ("" when it runs no model)."""
        ...


def nothing() -> None:
    return None


class StatelessProposer:
    """A proposer that holds nothing per sequence (the service keeps the tokens); works on any vocabulary."""

    vocab_size = 0
    vocab_fingerprint = ""
    feature_width = 0
    target_fingerprint = ""

    def phases(self) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        return nothing, nothing, nothing

    def forget(self, request_id: str) -> None:
        return None

    num_used_kv_pages = 0
    num_kv_pages = 0

    @property
    def kernels(self) -> str:
        return ""
