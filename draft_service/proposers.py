"""Proposers: given whole sequences, propose up to k continuation tokens each.

One small interface (`Proposer`) with the implementations users run:

- `NgramProposer`: prompt lookup. The continuation of the latest earlier occurrence of
  the sequence's last n tokens, for n from `ngram_max` down to `ngram_min`. A proposal
  is a deterministic function of the sequence, so its distribution is a point mass.
- `ModelProposer`: a small Llama-family draft model run by the target's model code, with
  KV pages per sequence that follow the sequence (cut back when tokens are dropped).
  Greedy requests get its argmax; sampled ones a token drawn from its truncated
  distribution, which is sent along (sparse) for lossless verification.
- `EagleProposer`: an EAGLE-style head trained for one target (`specserve distill`),
  reading the target's own final hidden states, which the scheduler forwards with the
  tokens; it proposes among its draft vocabulary, mapped back to the target's ids.
- `PhraseProposer`: prompt lookup, then the target's own phrases, kept in a draft folder
  by `specserve distill` (`modeling.phrases`): what most often followed the longest match
  of the sequence's last tokens in the target's answers (after a match of 1 or 2 tokens,
  only as many). A point mass too.
- `LookupThenHead`: a lookup (prompt lookup, or prompt lookup then phrases: a `LookupProposer`)
  where it finds something, the head everywhere else.

Proposers for tests live in `draft_service.testing_proposers`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import torch

from draft_service.sequences import SequencePages
from modeling.batch import SeqSpan
from modeling.config import ModelConfig, vocab_fingerprint
from modeling.eagle import EagleEngine, check_target
from modeling.engine import ModelEngine
from modeling.kv_cache import DEFAULT_PAGE_SIZE
from modeling.phrases import FILE_NAME as PHRASE_FILE
from modeling.phrases import MIN_CHANCE as PHRASE_MIN_CHANCE
from modeling.phrases import MIN_CONTEXT as PHRASE_MIN_CONTEXT
from modeling.phrases import PhraseStore
from modeling.trees import best_tree, is_chain
from modeling.sampling import generator_for, is_greedy, target_probs
from proto.messages import SamplingParams, SparseDist

# The draft's draws use their own stream, apart from the target's draws at the same positions.
_DRAFT_STREAM = 0x2545F4914F6CDD1D
# In a token tree: how often prompt lookup's guess at each depth is the target's next token,
# given the guesses before it were (n-gram lengths 2-4), measured on the tuning requests
# (bench/spec_prompts.py TUNING) as modeling.phrases.TRUST_BY_MATCH was.
LOOKUP_TRUST = (0.74, 0.82, 0.84, 0.9, 0.91, 0.92)


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


@dataclass(frozen=True)
class Proposed:
    token_ids: list[int]  # possibly empty
    dists: list[SparseDist] | None = None  # per token, what it was drawn from; None = a point mass
    parents: list[int] | None = None  # a token tree (modeling.trees; point masses only); None = a chain
    source: str = ""  # which proposer made it: "lookup", "phrases", "head", "model" (m.Proposal.source)


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


class LookupProposer(StatelessProposer):
    """A stateless proposer whose proposal is one lookup over the sequence's tokens (a point mass)."""

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        raise NotImplementedError

    def find(self, tokens: list[int], k: int) -> Proposed:
        """The lookup's chain, named by its source."""
        return Proposed(self.lookup(tokens, k), source="lookup")

    def propose(self, batch: list[ProposeInput]) -> list[Proposed]:
        return [self.find(item.token_ids, item.num_tokens) for item in batch]


class NgramProposer(LookupProposer):
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self._ngram_min = ngram_min
        self._ngram_max = ngram_max

    def phases(self) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        return nothing, nothing, self.self_check

    def self_check(self) -> None:
        sequence = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
        proposal = self.lookup(sequence, 3)
        if proposal != [8, 9, 1]:
            raise RuntimeError(f"n-gram self-check: expected [8, 9, 1], got {proposal}")

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens after the latest earlier occurrence of the last n tokens, trying the longest n first."""
        length = len(tokens)
        for n in range(min(self._ngram_max, length - 1), self._ngram_min - 1, -1):
            pattern = tokens[length - n:]
            last = pattern[-1]
            # Candidate ends of an earlier occurrence, latest first: positions < length - 1 holding `last`.
            end = length - 2
            while end >= n - 1:
                if tokens[end] == last and tokens[end - n + 1:end + 1] == pattern:
                    return tokens[end + 1:end + 1 + k]
                end -= 1
        return []


class PhraseProposer(LookupProposer):
    """Prompt lookup, then the target's own phrases (modeling/phrases.py) from a draft folder made for this target.

    `min_context`: the shortest phrase match it proposes from. Alone it takes any match
    (a short one proposes one or two tokens); before a head, only matches of FULL_CONTEXT
    tokens, and the head guesses where those fail (its first token is right more often
    than a short match's).
    """

    def __init__(self, folder: Path, target_folder: Path, prompt_lookup: NgramProposer,
                 min_context: int = PHRASE_MIN_CONTEXT, trees: bool = True) -> None:
        meta = check_target(folder, target_folder)  # refuses a folder made for another target, as a head does
        self.vocab_size = ModelConfig.from_folder(target_folder).vocab_size
        self.vocab_fingerprint = meta.vocab_fingerprint
        self.target_fingerprint = meta.target_fingerprint
        self._folder, self._prompt_lookup, self._min_context, self._trees = folder, prompt_lookup, min_context, trees
        self._phrases: PhraseStore | None = None

    def phases(self) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        return self._load, nothing, self._prompt_lookup.self_check

    def _load(self) -> None:
        self._phrases = PhraseStore.load(self._folder, self.vocab_size)
        if self._phrases is None:
            raise FileNotFoundError(f"{self._folder} has no {PHRASE_FILE} (`specserve distill` writes one beside the head)")

    @property
    def num_phrase_tokens(self) -> int:
        return self._phrases.num_tokens if self._phrases is not None else 0

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        return self.find(tokens, k).token_ids

    def find(self, tokens: list[int], k: int) -> Proposed:
        assert self._phrases is not None  # loaded
        if found := self._prompt_lookup.lookup(tokens, k):
            return Proposed(found, source="lookup")
        return Proposed(self._phrases.continue_(tokens, k, self._min_context), source="phrases")

    def propose(self, batch: list[ProposeInput]) -> list[Proposed]:
        """A token tree of up to k nodes (with `trees`; its tokens are point masses, verified greedily or by the
        target's own draws), else the lookup's chain.

        A tree's node must be likelier than MIN_CHANCE times the sequences proposed for
        at once: alone in its step a sequence's few extra rows cost the target almost
        nothing, but in a step of many every row costs its share.
        """
        min_chance = PHRASE_MIN_CHANCE * len(batch)
        return [self.tree(item.token_ids, item.num_tokens, min_chance) if self._trees
                else self.find(item.token_ids, item.num_tokens) for item in batch]

    def tree(self, tokens: list[int], k: int, min_chance: float = PHRASE_MIN_CHANCE) -> Proposed:
        """The k likeliest guesses (none less likely than min_chance) of the phrases' branches and prompt lookup's
        chain, as one token tree (its source "lookup" where prompt lookup found a chain, else "phrases")."""
        assert self._phrases is not None  # loaded
        chances = self._phrases.guesses(tokens, k, self._min_context, min_chance)
        chance = 1.0
        lookup = self._prompt_lookup.lookup(tokens, k)
        for depth in range(len(lookup)):
            chance *= LOOKUP_TRUST[min(depth, len(LOOKUP_TRUST) - 1)]
            branch = tuple(lookup[: depth + 1])
            chances[branch] = max(chances.get(branch, 0.0), chance)
        token_ids, parents = best_tree(chances, k, min_chance)
        return Proposed(token_ids, parents=None if is_chain(parents) else parents, source="lookup" if lookup else "phrases")


def warm_up_sequences(proposer: Proposer, num_slots: int, k: int, feature_width: int = 0) -> None:
    """A proposal for `num_slots` sequences at once at the longest k, greedy and sampled; then they are forgotten."""
    prompt = [(11 * i + 5) % proposer.vocab_size for i in range(8)]
    features = None
    if feature_width:
        features = torch.randn(len(prompt) - 1, feature_width, generator=torch.Generator().manual_seed(0))
    batch = [ProposeInput(f"warm-up-{i}", prompt, 0, k, SamplingParams(temperature=float(i % 2), seed=i), features)
             for i in range(num_slots)]
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


class ModelProposer(SlottedModelProposer[ModelEngine]):
    """A draft model with its own paged KV cache; a sequence it has no pages for gets no proposal."""

    feature_width = 0
    target_fingerprint = ""
    source = "model"

    def __init__(self, folder: Path, *, device: str, dtype: str, num_seqs: int, max_len: int, max_draft_tokens: int,
                 draft_top_k: int, quantization: str = "none") -> None:
        self._config = ModelConfig.from_folder(folder)
        if max_len > self._config.max_position_embeddings:
            raise ValueError(f"--max-model-len {max_len} exceeds the draft model's {self._config.max_position_embeddings} positions")
        self.vocab_size = self._config.vocab_size
        self.vocab_fingerprint = vocab_fingerprint(folder)
        self._pages = SequencePages(num_seqs, max_len, DEFAULT_PAGE_SIZE)
        self._engine = ModelEngine(folder, self._config, device=device, dtype=dtype, num_pages=self._pages.pool.num_pages,
                                   max_len=max_len, page_size=DEFAULT_PAGE_SIZE, quantization=quantization)
        self._num_seqs = num_seqs
        self._max_draft_tokens = max_draft_tokens
        self._draft_top_k = draft_top_k

    def _warm_up(self) -> None:
        # No batch-invariance check, unlike a target's: the target verifies every draft token, so a draft
        # model's rows may differ with the batch without changing any output.
        warm_up_sequences(self, self._num_seqs, self._max_draft_tokens)

    def forget(self, request_id: str) -> None:
        self._pages.release(request_id)

    def propose(self, batch: list[ProposeInput]) -> list[Proposed]:
        tokens: dict[str, list[int]] = {}  # proposed so far, per sequence
        dists: dict[str, list[SparseDist]] = {}
        active: list[ProposeInput] = []
        spans: list[SeqSpan] = []
        for item in batch:
            n = len(item.token_ids)
            pages = self._pages.reserve(item.request_id, min(n + item.num_tokens, self._engine.max_len)) if n < self._engine.max_len else None
            if pages is None:
                continue
            # The keys and values stand where the sequence did not change; catch up from there.
            # The last token is always fed, so there is a row to sample from.
            cached = min(self._pages.length(item.request_id), item.num_stable, n - 1)
            spans.append(SeqSpan(pages, cached, item.token_ids[cached:], 1))
            active.append(item)
            tokens[item.request_id], dists[item.request_id] = [], []
        while active:
            logits = self._engine.forward(spans)
            for item, span in zip(active, spans):
                self._pages.set_length(item.request_id, span.start + len(span.token_ids))
            next_active: list[ProposeInput] = []
            next_spans: list[SeqSpan] = []
            for row, (item, span) in enumerate(zip(active, spans)):
                position = span.start + len(span.token_ids)
                token = self._draw(logits[row], item.sampling, position, dists[item.request_id])
                tokens[item.request_id].append(token)
                if len(tokens[item.request_id]) < item.num_tokens and position + 1 < self._engine.max_len:
                    next_active.append(item)
                    next_spans.append(SeqSpan(span.pages, position, [token], 1))
            active, spans = next_active, next_spans
        return [
            Proposed(tokens.get(item.request_id, []), None if is_greedy(item.sampling) else dists.get(item.request_id, []),
                     source=self.source)
            for item in batch
        ]

    def _draw(self, logits: torch.Tensor, params: SamplingParams, position: int, dists: list[SparseDist]) -> int:
        return draw(logits, params, position, dists, self._draft_top_k, None)


def draw(logits: torch.Tensor, params: SamplingParams, position: int, dists: list[SparseDist], top_k: int,
         token_ids: torch.Tensor | None) -> int:
    """The draft's token from its logits: the argmax when greedy, else a draw from its `top_k` most likely (the
    distribution drawn from is appended to `dists`). `token_ids` maps logit columns to vocabulary ids (None: the same)."""
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


class EagleProposer(SlottedModelProposer[EagleEngine]):
    """An EAGLE-style head (modeling/eagle.py) with its own paged KV cache.

    Draft position j holds the pair (target feature f_j, token x_{j+1}). The pairs built
    from the target's own features stand until the sequence changes before them; the
    pairs a proposal adds (built from the head's predicted features) are recomputed from
    the target's features on the next request, since the scheduler sends those then.
    """

    source = "head"

    def __init__(self, folder: Path, target_folder: Path, *, device: str, dtype: str, num_seqs: int, max_len: int,
                 max_draft_tokens: int, draft_top_k: int) -> None:
        self._pages = SequencePages(num_seqs, max_len, DEFAULT_PAGE_SIZE)
        self._engine = EagleEngine(folder, target_folder, device=device, dtype=dtype, num_pages=self._pages.pool.num_pages,
                                   max_len=max_len, page_size=DEFAULT_PAGE_SIZE)
        self._num_seqs = num_seqs
        config = self._engine.config
        if max_len > config.max_position_embeddings:
            raise ValueError(f"--max-model-len {max_len} exceeds the target's {config.max_position_embeddings} positions")
        self.vocab_size = config.vocab_size
        self.vocab_fingerprint = self._engine.meta.vocab_fingerprint
        self.target_fingerprint = self._engine.meta.target_fingerprint
        self.feature_width = config.hidden_size
        self._from_target: dict[str, int] = {}  # per sequence: leading draft positions built from the target's features
        self._max_draft_tokens = max_draft_tokens
        self._draft_top_k = draft_top_k

    def _warm_up(self) -> None:
        warm_up_sequences(self, self._num_seqs, self._max_draft_tokens, self.feature_width)

    def forget(self, request_id: str) -> None:
        self._pages.release(request_id)
        self._from_target.pop(request_id, None)

    def propose(self, batch: list[ProposeInput]) -> list[Proposed]:
        tokens: dict[str, list[int]] = {}
        dists: dict[str, list[SparseDist]] = {}
        active: list[ProposeInput] = []
        spans: list[SeqSpan] = []
        rows: list[torch.Tensor] = []
        for item in batch:
            n = len(item.token_ids)
            if item.features is None or item.features.shape[0] < n - 1 or n < 2 or n >= self._engine.max_len:
                continue  # without every feature the head has nothing sound to read
            pages = self._pages.reserve(item.request_id, min(n - 1 + item.num_tokens, self._engine.max_len))
            if pages is None:
                continue
            # Pairs before `cached` stand; pair n-2 (the last token and the feature before it) is always fed.
            cached = max(0, min(self._from_target.get(item.request_id, 0), item.num_stable - 1, n - 2))
            spans.append(SeqSpan(pages, cached, item.token_ids[cached + 1 : n], 1))
            rows.append(item.features[cached : n - 1])
            self._from_target[item.request_id] = n - 1
            active.append(item)
            tokens[item.request_id], dists[item.request_id] = [], []
        while active:
            logits, predicted = self._engine.forward(spans, torch.cat(rows))
            next_active: list[ProposeInput] = []
            next_spans: list[SeqSpan] = []
            next_rows: list[torch.Tensor] = []
            for row, (item, span) in enumerate(zip(active, spans)):
                position = span.start + len(span.token_ids)
                self._pages.set_length(item.request_id, position)
                token = draw(logits[row], item.sampling, len(item.token_ids) + len(tokens[item.request_id]), dists[item.request_id],
                             self._draft_top_k, self._engine.draft_vocab)
                tokens[item.request_id].append(token)
                if len(tokens[item.request_id]) < item.num_tokens and position + 1 < self._engine.max_len:
                    next_active.append(item)
                    next_spans.append(SeqSpan(span.pages, position, [token], 1))
                    next_rows.append(predicted[row : row + 1])
            active, spans, rows = next_active, next_spans, next_rows
        return [
            Proposed(tokens.get(item.request_id, []), None if is_greedy(item.sampling) else dists.get(item.request_id, []),
                     source=self.source)
            for item in batch
        ]


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
        rest = [replace(item, num_tokens=min(item.num_tokens, self._head_tokens))
                for item, proposed in zip(batch, found) if not proposed.token_ids]
        from_head = iter(self._head.propose(rest) if rest else [])
        return [proposed if proposed.token_ids else next(from_head) for proposed in found]


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        first()
        second()

    return run
