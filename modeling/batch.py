"""Packs the sequences of one step into the index tensors the model's forward pass uses.

Every new token of every sequence becomes one row of a packed batch `[N]`, so the
linear layers never see padding. Attention is planned in groups: sequences with few new
tokens (decode, verify) attend together with their queries padded to the longest;
each sequence with many new tokens (a prefill chunk) attends alone.

A span's trailing tokens may form a token tree (`SeqSpan.parents`): several guesses at
the same position verified in one pass. Its nodes lie in the cache one after another,
in node order, but each takes the position of its depth for RoPE and attends only to the
sequence's standing tokens, its ancestors and itself, in that order: exactly the keys a
decode step at its place in its own branch would see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling.trees import is_chain, tree_depths

# Sequences with at most this many new tokens share one padded attention call.
MAX_SHARED_QUERY_TOKENS = 16


@dataclass(frozen=True)
class SeqSpan:
    """New tokens `token_ids` of the sequence in `slot`, at positions start .. start+len-1."""

    slot: int
    start: int
    token_ids: list[int]
    num_logits: int  # logits wanted for the last num_logits new positions (0: none)
    # A token tree: the parent of each of the last len(parents) tokens, as an index among
    # them (always an earlier one), or -1 for the token before them. None: one chain.
    parents: tuple[int, ...] | None = None


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended in one call: R rows of up to T query positions each."""

    slot_start: int  # rows are slots slot_start .. slot_start+R-1 when slot_index is None
    slot_index: torch.Tensor | None  # [R] slot of each row, when they are not one run
    num_rows: int  # R
    num_query_tokens: int  # T
    kv_len: int  # L: key positions attended, the longest row's end
    query_rows: torch.Tensor  # [R*T] packed row of each padded query (padding repeats row 0)
    mask: torch.Tensor | None  # [R, 1, T, L] additive: 0 where allowed, -inf elsewhere; None: all allowed
    real: torch.Tensor  # [K] indices into the R*T padded queries that are real tokens
    real_rows: torch.Tensor  # [K] packed row of each real query, aligned with `real`
    is_identity: bool  # the padded queries are exactly the packed rows 0..N-1 in order (no gather, no scatter)


@dataclass(frozen=True)
class StepBatch:
    token_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] each token's position in its sequence (RoPE)
    slots: torch.Tensor  # [N] slot of each token
    logit_rows: torch.Tensor  # [M] packed rows whose logits are returned, in span order
    groups: list[AttentionGroup]
    # With `rows_in_kernel`, nothing is planned as a group: every row goes to the CPU
    # attention kernel, which reads each row's slot alone.
    all_rows_in_kernel: bool = False
    # With a token tree in the step (else all three are `positions` and None): where each
    # token's keys and values are stored in its slot, the last of the contiguous cache
    # positions 0 .. it attends to, and [N, E] the further positions it attends to (a
    # tree node's ancestors and its own), -1 past the last.
    cache_positions: torch.Tensor | None = None
    attend_ends: torch.Tensor | None = None
    extra: torch.Tensor | None = None

    @property
    def stored_at(self) -> torch.Tensor:
        return self.positions if self.cache_positions is None else self.cache_positions

    @property
    def attended_to(self) -> torch.Tensor:
        return self.positions if self.attend_ends is None else self.attend_ends


def build_step_batch(spans: list[SeqSpan], device: torch.device, *, rows_in_kernel: bool = False) -> StepBatch:

    token_ids: list[int] = []
    slots: list[int] = []
    logit_rows: list[int] = []
    offsets: list[int] = []
    rows = _Rows()
    for span in spans:
        offsets.append(len(token_ids))
        n = len(span.token_ids)
        token_ids.extend(span.token_ids)
        rows.add(span)
        slots.extend([span.slot] * n)
        logit_rows.extend(range(len(token_ids) - span.num_logits, len(token_ids)))
    groups = [] if rows_in_kernel else _plan_groups(spans, offsets, rows, len(token_ids), device)

    cache_positions = attend_ends = extra = None
    if rows.extra:
        cache_positions, attend_ends = _ids(rows.stored_at, device), _ids(rows.attend_ends, device)
        width = max(len(keys) for keys in rows.extra.values())
        extra = torch.full((len(token_ids), width), -1, dtype=torch.long)  # -1 past a row's last extra position
        for row, keys in rows.extra.items():
            extra[row, : len(keys)] = torch.tensor(keys)
        extra = extra.to(device)
    return StepBatch(_ids(token_ids, device), _ids(rows.positions, device), _ids(slots, device), _ids(logit_rows, device),
                     groups, all_rows_in_kernel=rows_in_kernel,
                     cache_positions=cache_positions, attend_ends=attend_ends, extra=extra)


class _Rows:
    """Per packed row: its position (RoPE), where it is stored, the last of the cache positions 0 .. it attends to,
    and for a tree node the further positions it attends to (its ancestors' and its own)."""

    def __init__(self) -> None:
        self.positions: list[int] = []
        self.stored_at: list[int] = []
        self.attend_ends: list[int] = []
        self.extra: dict[int, tuple[int, ...]] = {}

    def add(self, span: SeqSpan) -> None:
        n = len(span.token_ids)
        if span.parents is None or is_chain(span.parents):
            for column in (self.positions, self.stored_at, self.attend_ends):
                column.extend(range(span.start, span.start + n))
            return
        if len(span.parents) > n - 1:
            raise ValueError(f"a tree of {len(span.parents)} nodes needs a token before it; the span has {n} tokens")
        depths = tree_depths(span.parents)
        root = span.start + n - len(span.parents) - 1  # the last token before the tree
        for column in (self.positions, self.stored_at, self.attend_ends):
            column.extend(range(span.start, root + 1))
        paths: list[tuple[int, ...]] = []
        for node, parent in enumerate(span.parents):
            paths.append((paths[parent] if parent >= 0 else ()) + (root + 1 + node,))
            self.extra[len(self.positions)] = paths[node]
            self.positions.append(root + depths[node])
            self.stored_at.append(root + 1 + node)
            self.attend_ends.append(root)


def _plan_groups(spans: list[SeqSpan], offsets: list[int], rows: _Rows, num_tokens: int,
                 device: torch.device) -> list[AttentionGroup]:
    """Short spans attend together, each long one (a prefill chunk) alone."""
    shared = [i for i, span in enumerate(spans) if len(span.token_ids) <= MAX_SHARED_QUERY_TOKENS]
    alone = [[i] for i, span in enumerate(spans) if len(span.token_ids) > MAX_SHARED_QUERY_TOKENS]
    planned = ([shared] if shared else []) + alone
    return [_plan_group([spans[i] for i in g], [offsets[i] for i in g], rows, num_tokens, device) for g in planned]


def _plan_group(spans: list[SeqSpan], offsets: list[int], rows: _Rows, num_tokens: int,
                device: torch.device) -> AttentionGroup:
    slot_lo = min(s.slot for s in spans)
    slot_hi = max(s.slot for s in spans) + 1
    # A run of slots is one view of the cache; holes in it cost wasted rows, so use it
    # only while the holes are few, else gather the rows' slots.
    as_run = slot_hi - slot_lo <= 2 * len(spans)
    row_of_slot = {s.slot: i for i, s in enumerate(spans)}
    row_slots = list(range(slot_lo, slot_hi)) if as_run else [s.slot for s in spans]
    num_rows = len(row_slots)
    num_query = max(len(s.token_ids) for s in spans)
    kv_len = max(s.start + len(s.token_ids) for s in spans)
    query_rows = [0] * (num_rows * num_query)
    query_pos = [[0] * num_query for _ in range(num_rows)]
    real: list[int] = []
    real_rows: list[int] = []
    tree_keys: dict[tuple[int, int], tuple[int, ...]] = {}  # (r, t) of a tree node -> the further positions it sees
    for r, slot in enumerate(row_slots):
        i = row_of_slot.get(slot)
        if i is None:
            continue
        span = spans[i]
        for t in range(len(span.token_ids)):
            packed = offsets[i] + t
            query_rows[r * num_query + t] = packed
            query_pos[r][t] = rows.attend_ends[packed]
            if packed in rows.extra:
                tree_keys[r, t] = rows.extra[packed]
            real.append(r * num_query + t)
            real_rows.append(offsets[i] + t)
    # One-token rows that all end at kv_len (a decode batch of equal lengths) attend to everything.
    needs_mask = bool(tree_keys) or any(query_pos[r][t] != kv_len - 1 for r in range(num_rows) for t in range(num_query))
    mask = _causal_mask(query_pos, kv_len, device, tree_keys) if needs_mask else None

    return AttentionGroup(
        slot_start=slot_lo,
        slot_index=None if as_run else _ids(row_slots, device),
        num_rows=num_rows,
        num_query_tokens=num_query,
        kv_len=kv_len,
        query_rows=_ids(query_rows, device),
        mask=mask,
        real=_ids(real, device),
        real_rows=_ids(real_rows, device),
        is_identity=num_rows * num_query == num_tokens and real == real_rows == list(range(num_tokens)),
    )


def _causal_mask(query_pos: list[list[int]], kv_len: int, device: torch.device,
                 tree_keys: dict[tuple[int, int], tuple[int, ...]]) -> torch.Tensor:
    """`[R, 1, T, L]`: query (r, t) with end p may see key positions 0..p, and a tree node its `tree_keys` too."""
    pos = torch.tensor(query_pos, dtype=torch.long, device=device)  # [R, T]
    allowed = torch.arange(kv_len, device=device).view(1, 1, kv_len) <= pos.unsqueeze(-1)  # [R, T, L]
    for (r, t), keys in tree_keys.items():
        allowed[r, t, list(keys)] = True
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=device).masked_fill_(~allowed, float("-inf"))
    return mask.unsqueeze(1)


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
