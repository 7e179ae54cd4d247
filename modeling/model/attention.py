"""Attention over the paged KV cache on torch ops, and the per-step windows both paths read.

The decoder (modeling/model/decoder.py) runs attention through the native kernel when the
model has it, reading the cache's pages in place; otherwise through these torch ops, which
gather each row's pages into whole matrices first. Both read the same sliding-window limits,
built once per step per distinct window width.
"""

from __future__ import annotations

from types import ModuleType

import torch

from modeling.model.batch import StepBatch


class Window:
    """What attention needs for one window width in one step: each row's first position (native kernel) or masks."""

    def __init__(self, firsts: torch.Tensor | None, masks: list[torch.Tensor | None]) -> None:
        self.firsts = firsts  # [N] or None (no window)
        self.masks = masks  # per attention group: [R, 1, T, L] additive, or None


class Windows:
    """Built once per step and window width: sliding layers share them."""

    def __init__(self, batch: StepBatch, dtype: torch.dtype) -> None:
        self._batch = batch
        self._dtype = dtype
        self._built: dict[int | None, Window] = {}

    def of(self, width: int | None) -> Window:
        if width not in self._built:
            self._built[width] = self._build(width)
        return self._built[width]

    def _build(self, width: int | None) -> Window:
        batch = self._batch
        plain = [None if g.mask is None else g.mask.to(self._dtype) for g in batch.groups]
        if width is None:
            return Window(None, plain)
        # A row at position p sees positions p - width + 1 .. p; a tree node's ancestors lie within its
        # depth, so only the standing positions it attends can fall out of the window.
        firsts = (batch.positions - (width - 1)).clamp_(min=0)
        if batch.extra is not None and bool((firsts > batch.attended_to + 1).any()):
            raise ValueError(f"a token tree deeper than the model's sliding window ({width} positions)")
        if batch.all_rows_in_kernel:
            return Window(firsts, plain)
        masks: list[torch.Tensor | None] = []
        for group, mask in zip(batch.groups, plain):
            padded_firsts = firsts[group.query_rows].view(group.num_rows, 1, group.num_query_tokens, 1)
            outside = torch.arange(group.kv_len, device=firsts.device).view(1, 1, 1, -1) < padded_firsts  # [R, 1, T, L]
            window = torch.zeros(outside.shape, dtype=self._dtype, device=firsts.device).masked_fill_(
                outside, float("-inf")
            )
            masks.append(window if mask is None else mask + window)
        return Window(firsts, masks)


def native_attend(
    native: ModuleType,
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    batch: StepBatch,
    scale: float,
    firsts: torch.Tensor | None,
) -> torch.Tensor:
    """The attention kernel over rows that attend to positions firsts (or 0) .. ends, and then, where given, to their
    `extra` ones."""
    if batch.extra is None:
        return native.attend(q, keys, values, batch.tables, batch.row_tables, batch.attended_to, scale, firsts)
    return native.attend_tree(
        q, keys, values, batch.tables, batch.row_tables, batch.attended_to, batch.extra, scale, firsts
    )


def gather_pages(store: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0 .. length-1 of each row's pages `[R, W]` as one block per row: `[R, KVH, length, D]` (a copy:
    torch's batched matmul reads a batch as whole matrices; the native kernel reads pages in place)."""
    r, width = tables.shape
    _, kvh, page_size, d = store.shape
    pages = store[tables.reshape(-1)].view(r, width, kvh, page_size, d)
    return pages.transpose(1, 2).reshape(r, kvh, width * page_size, d)[:, :, :length]


def grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, g: int, scale: float
) -> torch.Tensor:
    """Softmax attention, q `[R, H, T, D]` over k, v `[R, KVH, L, D]` with H = KVH * G -> `[R, H, T, D]`.

    k and v are each row's keys and values in one block (gathered from its pages).
    """
    r, h, t, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    qg = q.reshape(r * kvh, g * t, d)  # heads split as [KVH, G]: the G query heads of a kv head, stacked
    keys, values = k.reshape(r * kvh, length, d), v.reshape(r * kvh, length, d)
    # Scores as keys @ queries^T: on CPU, bf16 batched matmul is ~25% faster with the cache's
    # rows as the left operand; turned back to [R*KVH, G*T, L] so softmax runs along memory.
    scores = torch.bmm(keys, qg.transpose(1, 2)).transpose(1, 2).float() * scale  # [R*KVH, G*T, L]
    if mask is not None:  # [R, 1, T, L], the same for the G heads of each kv head
        scores = scores.view(r, kvh, g, t, length).add_(mask.unsqueeze(1)).view(r * kvh, g * t, length)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.bmm(probs, values).view(r, h, t, d)
