"""Packs the sequences of one step into the index tensors the model's forward pass uses.

Every new token of every sequence becomes one row of a packed batch `[N]`, so the
linear layers never see padding. Each sequence brings its block table, the pages of the
KV cache that hold its positions in order (modeling/model/kv_cache.py); a token's keys and
values are stored at page `table[p // page_size]`, offset `p % page_size`.

The native attention kernel reads every row through its block table. For torch ops
attention is planned in groups: sequences with few new tokens (decode, verify) attend
together with their queries padded to the longest; each sequence with many new tokens
(a prefill chunk) attends alone; a group's pages are gathered into one block per row.

A span's trailing tokens may form a token tree (`SeqSpan.parents`): several guesses at
the same position verified in one pass. Its nodes lie in the cache one after another,
in node order, but each takes the position of its depth for RoPE and attends only to the
sequence's standing tokens, its ancestors and itself, in that order: exactly the keys a
decode step at its place in its own branch would see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.trees import is_chain, tree_depths

# Sequences with at most this many new tokens share one padded attention call.
MAX_SHARED_QUERY_TOKENS = 16


class PageError(ValueError):
    """A step asked for something inconsistent with the pages it names (a protocol error).

    `request_id` names the request when its own content is at fault (not the step's plan).
    """

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


@dataclass(frozen=True)
class SeqSpan:
    """New tokens `token_ids` of the sequence whose block table is `pages`, at positions start .. start+len-1."""

    pages: tuple[int, ...]
    start: int
    token_ids: list[int]
    num_logits: int  # logits wanted for the last num_logits new positions (0: none)
    # A token tree: the parent of each of the last len(parents) tokens, as an index among
    # them (always an earlier one), or -1 for the token before them. None: one chain.
    parents: tuple[int, ...] | None = None


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended in one call (torch ops): R rows of up to T query positions each."""

    tables: torch.Tensor  # [R, W] each row's pages holding positions 0 .. W*page_size-1 (padded with page 0)
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
    tables: torch.Tensor  # [S, W] the block table of each span, padded with page 0
    row_tables: torch.Tensor  # [N] each row's block table: its span's index
    store_pages: torch.Tensor  # [N] the page each row's keys and values are written to
    store_offsets: torch.Tensor  # [N] and their offset in it
    logit_rows: torch.Tensor  # [M] packed rows whose logits are returned, in span order
    groups: list[AttentionGroup]
    # With `rows_in_kernel`, nothing is planned as a group: every row goes to the CPU
    # attention kernel, which reads each row's pages alone.
    all_rows_in_kernel: bool = False
    # With a token tree in the step (else all three are `positions` and None): where each
    # token's keys and values are stored in its sequence, the last of the contiguous cache
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


def build_step_batch(
    spans: list[SeqSpan], device: torch.device, page_size: int, *, rows_in_kernel: bool = False
) -> StepBatch:
    """Raises PageError when a span's block table does not reach its last position."""
    token_ids: list[int] = []
    row_tables: list[int] = []
    logit_rows: list[int] = []
    offsets: list[int] = []
    rows = StepRows()
    for index, span in enumerate(spans):
        offsets.append(len(token_ids))
        n = len(span.token_ids)
        if not span.pages or span.start + n > len(span.pages) * page_size:
            raise PageError(
                f"{len(span.pages)} pages of {page_size} positions cannot hold positions "
                f"{span.start} .. {span.start + n - 1}"
            )
        token_ids.extend(span.token_ids)
        rows.add(span)
        row_tables.extend([index] * n)
        logit_rows.extend(range(len(token_ids) - span.num_logits, len(token_ids)))
    store_pages = [spans[table].pages[at // page_size] for table, at in zip(row_tables, rows.stored_at)]
    store_offsets = [at % page_size for at in rows.stored_at]
    width = max(len(span.pages) for span in spans)
    tables = _ids([list(span.pages) + [0] * (width - len(span.pages)) for span in spans], device)
    groups = [] if rows_in_kernel else _plan_groups(spans, offsets, rows, len(token_ids), page_size, device)

    cache_positions = attend_ends = extra = None
    if rows.extra:
        cache_positions, attend_ends = _ids(rows.stored_at, device), _ids(rows.attend_ends, device)
        extra_width = max(len(keys) for keys in rows.extra.values())
        extra = torch.full((len(token_ids), extra_width), -1, dtype=torch.long)  # -1 past a row's last extra position
        for row, keys in rows.extra.items():
            extra[row, : len(keys)] = torch.tensor(keys)
        extra = extra.to(device)
    return StepBatch(
        _ids(token_ids, device),
        _ids(rows.positions, device),
        tables,
        _ids(row_tables, device),
        _ids(store_pages, device),
        _ids(store_offsets, device),
        _ids(logit_rows, device),
        groups,
        all_rows_in_kernel=rows_in_kernel,
        cache_positions=cache_positions,
        attend_ends=attend_ends,
        extra=extra,
    )


class StepRows:
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


def _plan_groups(
    spans: list[SeqSpan], offsets: list[int], rows: StepRows, num_tokens: int, page_size: int, device: torch.device
) -> list[AttentionGroup]:
    """Short spans attend together, each long one (a prefill chunk) alone."""
    shared = [i for i, span in enumerate(spans) if len(span.token_ids) <= MAX_SHARED_QUERY_TOKENS]
    alone = [[i] for i, span in enumerate(spans) if len(span.token_ids) > MAX_SHARED_QUERY_TOKENS]
    planned = ([shared] if shared else []) + alone
    return [
        _plan_group([spans[i] for i in g], [offsets[i] for i in g], rows, num_tokens, page_size, device)
        for g in planned
    ]


def _plan_group(
    spans: list[SeqSpan], offsets: list[int], rows: StepRows, num_tokens: int, page_size: int, device: torch.device
) -> AttentionGroup:
    num_rows = len(spans)
    num_query = max(len(s.token_ids) for s in spans)
    kv_len = max(s.start + len(s.token_ids) for s in spans)
    width = -(-kv_len // page_size)
    # Rows shorter than kv_len read page 0 past their end; the mask hides it.
    tables = [list(s.pages[:width]) + [0] * (width - len(s.pages[:width])) for s in spans]
    query_rows = [0] * (num_rows * num_query)
    query_pos = [[0] * num_query for _ in range(num_rows)]
    real: list[int] = []
    real_rows: list[int] = []
    tree_keys: dict[tuple[int, int], tuple[int, ...]] = {}  # (r, t) of a tree node -> the further positions it sees
    for r, span in enumerate(spans):
        for t in range(len(span.token_ids)):
            packed = offsets[r] + t
            query_rows[r * num_query + t] = packed
            query_pos[r][t] = rows.attend_ends[packed]
            if packed in rows.extra:
                tree_keys[r, t] = rows.extra[packed]
            real.append(r * num_query + t)
            real_rows.append(packed)
    # One-token rows that all end at kv_len (a decode batch of equal lengths) attend to everything.
    needs_mask = bool(tree_keys) or any(
        query_pos[r][t] != kv_len - 1 for r in range(num_rows) for t in range(num_query)
    )
    mask = _causal_mask(query_pos, kv_len, device, tree_keys) if needs_mask else None

    return AttentionGroup(
        tables=_ids(tables, device),
        num_rows=num_rows,
        num_query_tokens=num_query,
        kv_len=kv_len,
        query_rows=_ids(query_rows, device),
        mask=mask,
        real=_ids(real, device),
        real_rows=_ids(real_rows, device),
        is_identity=num_rows * num_query == num_tokens and real == real_rows == list(range(num_tokens)),
    )


def _causal_mask(
    query_pos: list[list[int]], kv_len: int, device: torch.device, tree_keys: dict[tuple[int, int], tuple[int, ...]]
) -> torch.Tensor:
    """`[R, 1, T, L]`: query (r, t) with end p may see key positions 0..p, and a tree node its `tree_keys` too."""
    pos = torch.tensor(query_pos, dtype=torch.long, device=device)  # [R, T]
    allowed = torch.arange(kv_len, device=device).view(1, 1, kv_len) <= pos.unsqueeze(-1)  # [R, T, L]
    for (r, t), keys in tree_keys.items():
        allowed[r, t, list(keys)] = True
    mask = torch.zeros(allowed.shape, dtype=torch.float32, device=device).masked_fill_(~allowed, float("-inf"))
    return mask.unsqueeze(1)


def _ids(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
