"""The head proposer: an EAGLE-style draft head trained for one target,
reading its final hidden states (`--draft eagle:PATH`)."""

from __future__ import annotations

from pathlib import Path

import torch

from draft_service.proposer import ProposeInput, Proposed
from draft_service.sequences import SequencePages
from draft_service.slotted_model import SlottedModelProposer, draw, warm_up_sequences
from modeling.model.batch import SeqSpan
from modeling.model.eagle import EagleEngine
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE
from modeling.sampling.draw import is_greedy
from proto.messages import SparseDist


class EagleProposer(SlottedModelProposer[EagleEngine]):
    """An EAGLE-style head (modeling/model/eagle.py) with its own paged KV cache.

    Draft position j holds the pair (target feature f_j, token x_{j+1}). The pairs built
    from the target's own features stand until the sequence changes before them; the
    pairs a proposal adds (built from the head's predicted features) are recomputed from
    the target's features on the next request, since the scheduler sends those then.
    """

    source = "head"

    def __init__(
        self,
        folder: Path,
        target_folder: Path,
        *,
        device: str,
        dtype: str,
        num_seqs: int,
        max_len: int,
        max_draft_tokens: int,
        draft_top_k: int,
    ) -> None:
        self._pages = SequencePages(num_seqs, max_len, DEFAULT_PAGE_SIZE)
        self._engine = EagleEngine(
            folder,
            target_folder,
            device=device,
            dtype=dtype,
            num_pages=self._pages.pool.num_pages,
            max_len=max_len,
            page_size=DEFAULT_PAGE_SIZE,
        )
        self._num_seqs = num_seqs
        config = self._engine.config
        if max_len > config.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {max_len} exceeds the target's {config.max_position_embeddings} positions"
            )
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
                token = draw(
                    logits[row],
                    item.sampling,
                    len(item.token_ids) + len(tokens[item.request_id]),
                    dists[item.request_id],
                    self._draft_top_k,
                    self._engine.draft_vocab,
                )
                tokens[item.request_id].append(token)
                if len(tokens[item.request_id]) < item.num_tokens and position + 1 < self._engine.max_len:
                    next_active.append(item)
                    next_spans.append(SeqSpan(span.pages, position, [token], 1))
                    next_rows.append(predicted[row : row + 1])
            active, spans, rows = next_active, next_spans, next_rows
        return [
            Proposed(
                tokens.get(item.request_id, []),
                None if is_greedy(item.sampling) else dists.get(item.request_id, []),
                source=self.source,
            )
            for item in batch
        ]
