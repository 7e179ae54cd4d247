"""The draft model proposer: a small Llama-family model run by the target's model code (`--draft model:PATH`)."""

from __future__ import annotations

from pathlib import Path

import torch

from draft_service.proposer import ProposeInput, Proposed
from draft_service.sequences import SequencePages
from draft_service.slotted_model import SlottedModelProposer, draw, warm_up_sequences
from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig, vocab_fingerprint
from modeling.model.engine import ModelEngine
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE
from modeling.sampling.draw import is_greedy
from proto.messages import SamplingParams, SparseDist


class ModelProposer(SlottedModelProposer[ModelEngine]):
    """A draft model with its own paged KV cache; a sequence it has no pages for gets no proposal."""

    feature_width = 0
    target_fingerprint = ""
    source = "model"

    def __init__(
        self,
        folder: Path,
        *,
        device: str,
        dtype: str,
        num_seqs: int,
        max_len: int,
        max_draft_tokens: int,
        draft_top_k: int,
        quantization: str = "none",
    ) -> None:
        self._config = ModelConfig.from_folder(folder)
        if max_len > self._config.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {max_len} exceeds the draft model's {self._config.max_position_embeddings} positions"
            )
        self.vocab_size = self._config.vocab_size
        self.vocab_fingerprint = vocab_fingerprint(folder)
        self._pages = SequencePages(num_seqs, max_len, DEFAULT_PAGE_SIZE)
        self._engine = ModelEngine(
            folder,
            self._config,
            device=device,
            dtype=dtype,
            num_pages=self._pages.pool.num_pages,
            max_len=max_len,
            page_size=DEFAULT_PAGE_SIZE,
            quantization=quantization,
        )
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
            pages = (
                self._pages.reserve(item.request_id, min(n + item.num_tokens, self._engine.max_len))
                if n < self._engine.max_len
                else None
            )
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
            Proposed(
                tokens.get(item.request_id, []),
                None if is_greedy(item.sampling) else dists.get(item.request_id, []),
                source=self.source,
            )
            for item in batch
        ]

    def _draw(self, logits: torch.Tensor, params: SamplingParams, position: int, dists: list[SparseDist]) -> int:
        return draw(logits, params, position, dists, self._draft_top_k, None)
