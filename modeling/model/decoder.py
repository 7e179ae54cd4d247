"""The decoder of every supported family (RMSNorm, RoPE, GQA, a gated MLP) over packed ragged batches and a paged KV cache.

One model code runs Llama, Mistral, Qwen2/3 and Gemma 3: the differences are switches of
`ModelConfig` (modeling/model/config.py) — biases, query/key norms, sliding windows per layer,
a RoPE per layer, and Gemma's sandwich norms, embedding scale and GELU-tanh MLP.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from modeling.model.batch import AttentionGroup, SeqSpan, StepBatch, build_step_batch
from modeling.model.config import ModelConfig
from modeling.kernels.huge_pages import HugePageRegion
from modeling.model.kv_cache import KVCache
from modeling.model.rope import Rope
from modeling.model.rope import rope_tables as rope_tables_of
from modeling.model.weights import WeightError, WeightFiles

__all__ = ["PROJECTION_PARTS", "DecoderLayer", "LlamaModel", "WeightError", "head_parts", "projection_parts"]

# A layer's projections as the model fuses them -> the transformers names of their parts, in row order.
PROJECTION_PARTS = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}


def _param(*shape: int, dtype: torch.dtype, device: torch.device, fill: float | None = None) -> torch.nn.Parameter:
    """A frozen parameter, allocated in the serving dtype and device (uninitialised unless `fill`)."""
    data = torch.empty(shape, dtype=dtype, device=device) if fill is None else torch.full(shape, fill, dtype=dtype, device=device)
    return torch.nn.Parameter(data, requires_grad=False)


def _weight(region: HugePageRegion, *shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    """A frozen, uninitialised matmul weight in `region`'s next place (a plain tensor off the CPU)."""
    return torch.nn.Parameter(region.empty(shape, dtype), requires_grad=False)


def _projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """A layer's fused projections (PROJECTION_PARTS' keys, in that order) -> their weights' [out, in] shapes."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return {"qkv_proj": (q_size + 2 * kv_size, hidden), "o_proj": (hidden, q_size),
            "gate_up_proj": (2 * inner, hidden), "down_proj": (hidden, inner)}


def _weight_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """The shapes of the matmul weights LlamaModel allocates, in the order it allocates them: the embeddings, each
    layer's projections, and an untied LM head."""
    head = [] if config.tie_word_embeddings else [(config.vocab_size, config.hidden_size)]
    layer = list(_projection_shapes(config).values())
    return [(config.vocab_size, config.hidden_size), *layer * config.num_layers, *head]


def norm_dtype(config: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """Gemma applies its norms in float32 (x * (1 + w), rounded once), so its weights stay float32; others' are in dtype."""
    return torch.float32 if config.gemma else dtype


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, weights: HugePageRegion) -> None:
        super().__init__()
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        hidden, inner = config.hidden_size, config.intermediate_size
        self.qkv_sizes = (q_size, kv_size, kv_size)

        def param(*shape: int, fill: float | None = None) -> torch.nn.Parameter:
            return _param(*shape, dtype=dtype, device=device, fill=fill)

        def bias(size: int, wanted: bool) -> torch.nn.Parameter | None:
            return param(size, fill=0.0) if wanted else None

        shapes = _projection_shapes(config)

        def weight(name: str) -> torch.nn.Parameter:
            return _weight(weights, *shapes[name], dtype=dtype)

        def norm(size: int) -> torch.nn.Parameter:
            return _param(size, dtype=norm_dtype(config, dtype), device=device, fill=1.0)

        # Norm weights are held as the factor they apply (Gemma's stored w is applied as 1 + w).
        self.input_norm = norm(hidden)
        self.qkv_proj = weight("qkv_proj")
        self.qkv_bias = bias(q_size + 2 * kv_size, config.attention_bias)
        self.q_norm = norm(config.head_dim) if config.qk_norm else None
        self.k_norm = norm(config.head_dim) if config.qk_norm else None
        self.o_proj = weight("o_proj")
        self.o_bias = bias(hidden, config.o_bias)
        self.post_attention_norm = norm(hidden)
        # Gemma's sandwich: post_attention_norm normalises the attention's output, these two the MLP's input and output.
        self.pre_mlp_norm = norm(hidden) if config.gemma else None
        self.post_mlp_norm = norm(hidden) if config.gemma else None
        self.gate_up_proj = weight("gate_up_proj")
        self.gate_up_bias = bias(2 * inner, config.mlp_bias)
        self.down_proj = weight("down_proj")
        self.down_bias = bias(hidden, config.mlp_bias)


class LlamaModel(torch.nn.Module):
    """Scores the new tokens of a step; `forward` returns the hidden states of `logit_rows`.

    Parameters are allocated in `dtype` on `device` and the weights read straight into them;
    on the CPU the matmul weights (embeddings, projections, LM head) lie in one region of huge
    pages (modeling/kernels/huge_pages.py), each at a page boundary.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> None:
        super().__init__()
        self.config = config
        device = torch.device(device)
        self._weights = HugePageRegion([rows * cols * dtype.itemsize for rows, cols in _weight_shapes(config)], device)
        self.embed_tokens = _weight(self._weights, config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers: list[DecoderLayer] = torch.nn.ModuleList(  # type: ignore[assignment]
            DecoderLayer(config, dtype, device, self._weights) for _ in range(config.num_layers))
        self.norm = _param(config.hidden_size, dtype=norm_dtype(config, dtype), device=device, fill=1.0)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else _weight(self._weights, config.vocab_size, config.hidden_size, dtype=dtype)
        )
        # y = x @ W^T (+ b); a built model may swap in a faster kernel (see cpu_kernels.py).
        self.linear: Callable[..., torch.Tensor] = F.linear
        # The native CPU kernels (modeling/kernels/native.py), when the built model has them: fused
        # norms, RoPE and SiLU, and attention of decode and verify rows over the cache in
        # place. Without them, torch ops do all of it.
        self.native: ModuleType | None = None
        # Each distinct RoPE of the layers and which one each layer uses; cos/sin built by set_rope_cache.
        ropes = [config.layer_rope(layer) for layer in range(config.num_layers)]
        self._ropes: list[Rope] = list(dict.fromkeys(ropes))
        self._layer_rope = [self._ropes.index(rope) for rope in ropes]
        self._rope_tables: list[tuple[torch.Tensor, torch.Tensor]] = []  # per distinct RoPE: [max_len, head_dim] each
        self._windows = [config.layer_window(layer) for layer in range(config.num_layers)]
        self._window_widths: list[int | None] = list(dict.fromkeys(self._windows))  # each distinct one
        self._embedding_rows: Callable[[torch.Tensor], torch.Tensor] | None = None  # see embed_from
        # The layers as one native call (csrc/layers.cpp: the same ops in the same order, the
        # same bits), set by `fuse_layers`; None runs them one op at a time from here.
        self.fused_layers: Any | None = None

    # ------------------------------------------------------------------ building

    def load_weights(self, folder: Path, skip: Collection[str] = ()) -> None:
        """Read the folder's safetensors (HF names; one file, several, or shards with their index) into the parameters.

        A parameter whose every part is in `skip` (weights served by another route: GGUF
        blocks) is left unread, its memory untouched, for its owner to replace.
        """
        copy_hf_weights(self, WeightFiles(folder), skip)

    def set_rope_cache(self, max_len: int) -> None:
        """Precompute cos/sin for positions 0..max_len-1 exactly as HF does (fp32, then cast)."""
        device, dtype = self.embed_tokens.device, self.embed_tokens.dtype
        self._rope_tables = []
        for rope in self._ropes:
            cos, sin = rope_tables_of(rope, self.config.head_dim, max_len, device)
            self._rope_tables.append((cos.to(dtype), sin.to(dtype)))

    # ------------------------------------------------------------------ forward

    def plan(self, spans: list[SeqSpan], page_size: int) -> StepBatch:
        """The step's packed batch, its attention planned for this model's kernels; raises PageError on a short block table."""
        return build_step_batch(spans, self.embed_tokens.device, page_size, rows_in_kernel=self.native is not None)

    def fuse_layers(self, projection: Callable[[torch.Tensor], tuple[int, str]], path: str) -> bool:
        """Run the layers as one call of the native kernels from now on, if they run this architecture (not Gemma's
        sandwich norms, query and key norms or GELU), and say whether they do. `projection(weight)`: a packed weight's
        outputs and block format ("" for a dense one); `path`: the linear kernel's instruction set."""
        cfg = self.config
        if self.native is None or cfg.gemma or cfg.qk_norm or cfg.hidden_act == "gelu_pytorch_tanh":
            return False
        packed: list[torch.Tensor] = []
        num_out: list[int] = []
        formats: list[str] = []
        biases: list[torch.Tensor | None] = []
        norms: list[torch.Tensor] = []
        for index, layer in enumerate(self.layers):
            for weight, bias in ((layer.qkv_proj, layer.qkv_bias), (layer.o_proj, layer.o_bias),
                                 (layer.gate_up_proj, layer.gate_up_bias), (layer.down_proj, layer.down_bias)):
                outputs, block_format = projection(weight)
                packed.append(weight)
                num_out.append(outputs)
                formats.append(block_format)
                biases.append(bias)
            following = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.norm
            norms += [layer.post_attention_norm, following]
        windows = [self._window_widths.index(width) for width in self._windows]
        self.fused_layers = self.native.DecoderStack(packed, num_out, biases, formats, norms, self._layer_rope, windows,
                                                     cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.attention_scale,
                                                     cfg.rms_norm_eps, path)
        return True

    def embed_from(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Read embeddings through `rows` (ids -> `[N, hidden]`) and free the table: a tied LM head, packed for the
        native kernels, holds the same rows, so one copy of a large vocabulary's table is enough."""
        self._embedding_rows = rows
        table = self.embed_tokens
        self.embed_tokens = torch.nn.Parameter(self.embed_tokens.new_empty(0, self.config.hidden_size), requires_grad=False)
        if table.data_ptr() != self.lm_head.data_ptr():  # the head is another copy (blocks), not this table packed
            self.release_weight(table)

    def release_weight(self, weight: torch.Tensor) -> None:
        """Free the memory of a matmul weight the model allocated and no longer reads (replaced by another copy)."""
        self._weights.release(weight)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `token_ids` `[N]` -> `[N, hidden]` (scaled by sqrt(hidden) for Gemma)."""
        x = F.embedding(token_ids, self.embed_tokens) if self._embedding_rows is None else self._embedding_rows(token_ids)
        if self.config.gemma:
            x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)
        return x

    def forward(self, batch: StepBatch, cache: KVCache, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Append the batch's tokens to the cache and return the final (normed) hidden states of every row `[N, hidden]`.

        `inputs` `[N, hidden]` replaces the token embeddings (a draft head feeds its own mix).
        """
        if not self._rope_tables:
            raise RuntimeError("set_rope_cache() must run before forward()")
        rotations = [(cos[batch.positions], sin[batch.positions]) for cos, sin in self._rope_tables]  # [N, D] each
        windows = _Windows(batch, self.embed_tokens.dtype)
        # [N, hidden], this pass's own copy: the native norms add to it in place
        x = self.embed(batch.token_ids) if inputs is None else inputs.clone(memory_format=torch.contiguous_format)
        h = self._norm(x, self.layers[0].input_norm)
        if self.fused_layers is not None:
            firsts = [windows.of(width).firsts for width in self._window_widths]
            return self.fused_layers.forward(x, h, cache.keys, cache.values, [cos for cos, _ in rotations],  # type: ignore[no-any-return]
                                             [sin for _, sin in rotations], firsts, batch.store_pages, batch.store_offsets,
                                             batch.tables, batch.row_tables, batch.attended_to, batch.extra)
        for index, layer in enumerate(self.layers):
            cos, sin = rotations[self._layer_rope[index]]
            attended = self._attention(index, layer, h, cos, sin, batch, windows.of(self._windows[index]), cache)
            if layer.pre_mlp_norm is not None and layer.post_mlp_norm is not None:  # Gemma's sandwich norms
                x, h = self._add_norm(x, self._norm(attended, layer.post_attention_norm), layer.pre_mlp_norm)
                mlp = self._norm(self._mlp(layer, h), layer.post_mlp_norm)
            else:
                x, h = self._add_norm(x, attended, layer.post_attention_norm)
                mlp = self._mlp(layer, h)
            following = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.norm
            x, h = self._add_norm(x, mlp, following)
        return h

    def _mlp(self, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
        gate_up = self.linear(h, layer.gate_up_proj, layer.gate_up_bias)
        return self.linear(self._act_mul(gate_up), layer.down_proj, layer.down_bias)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.rms_norm(x, weight, self.config.rms_norm_eps)
        return rms_norm(x, weight, self.config.rms_norm_eps)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its RMSNorm); the native op adds in place (x is this pass's own residual stream)."""
        if self.native is not None:
            return x, self.native.add_rms_norm_(x, delta, weight, self.config.rms_norm_eps)
        x = x + delta
        return x, rms_norm(x, weight, self.config.rms_norm_eps)

    def _act_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of each [gate | up] row."""
        if self.config.hidden_act == "gelu_pytorch_tanh":
            gate, up = gate_up.chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        if self.native is not None:
            return self.native.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def logits(self, hidden: torch.Tensor, widen: bool = True) -> torch.Tensor:
        """`[M, hidden]` -> logits `[M, vocab]`, in float32 (`widen`) or as the LM head computes them."""
        logits = self.linear(hidden, self.lm_head)
        return logits.float() if widen else logits

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's token by argmax `[M]` of logits `[M, vocab]`: the first of equal maxima, a NaN's if the row has
        one, as torch.argmax (whose reduction took as long as a 64-row step's LM head)."""
        if self.native is not None and logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16) \
                and logits.dim() == 2 and logits.size(1) > 0 and logits.stride(1) == 1:
            return self.native.argmax_rows(logits)  # type: ignore[no-any-return]
        return torch.argmax(logits, dim=-1)

    def _attention(
        self,
        index: int,
        layer: DecoderLayer,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: StepBatch,
        window: _Window,
        cache: KVCache,
    ) -> torch.Tensor:
        cfg = self.config
        n = h.shape[0]
        q_size, kv_size = layer.qkv_sizes[0], layer.qkv_sizes[1]
        qkv = self.linear(h, layer.qkv_proj, layer.qkv_bias)  # [N, (H + 2*KVH) * D]
        if layer.q_norm is not None and layer.k_norm is not None:  # each head's query and key normalised before RoPE
            for norm, heads in ((layer.q_norm, qkv[:, :q_size]), (layer.k_norm, qkv[:, q_size : q_size + kv_size])):
                view = heads.view(n, -1, cfg.head_dim)
                view.copy_(rms_norm(view, norm, cfg.rms_norm_eps))
        native = self.native
        # Queries and keys rotate together: one RoPE over H + KVH heads.
        if native is not None:
            native.rope_(qkv, cos, sin, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            q = qkv[:, :q_size].view(n, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(n, cfg.num_kv_heads, cfg.head_dim)
        else:
            qk = apply_rope(qkv[:, : q_size + kv_size].view(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim),
                            cos.unsqueeze(1), sin.unsqueeze(1))
            q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]  # [N, H, D], [N, KVH, D]
        v = qkv[:, q_size + kv_size :].view(n, cfg.num_kv_heads, cfg.head_dim)
        keys, values = cache.keys[index], cache.values[index]  # [pages, KVH, page_size, D]
        if native is not None:
            native.store(k, v, keys, values, batch.store_pages, batch.store_offsets)
        else:
            keys[batch.store_pages, :, batch.store_offsets] = k
            values[batch.store_pages, :, batch.store_offsets] = v
        scale = cfg.attention_scale
        if native is not None and batch.all_rows_in_kernel:
            attended = _native_attend(native, q, keys, values, batch, scale, window.firsts)
            return self.linear(attended, layer.o_proj, layer.o_bias)
        masks = window.masks
        if len(batch.groups) == 1 and batch.groups[0].is_identity:
            out = self._group_attention(batch.groups[0], masks[0], q, keys, values, scale)
            return self.linear(out, layer.o_proj, layer.o_bias)
        out = torch.empty(n, cfg.num_heads * cfg.head_dim, dtype=h.dtype, device=h.device)  # [N, H*D]
        for group, mask in zip(batch.groups, masks):
            out[group.real_rows] = self._group_attention(group, mask, q, keys, values, scale)
        return self.linear(out, layer.o_proj, layer.o_bias)

    def _group_attention(self, group: AttentionGroup, mask: torch.Tensor | None, q: torch.Tensor, keys: torch.Tensor,
                         values: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of one group's real queries: returns `[K, H*D]` aligned with group.real_rows."""
        cfg = self.config
        r, t, length = group.num_rows, group.num_query_tokens, group.kv_len
        rows = q if group.is_identity else q[group.query_rows]  # [R*T, H, D]
        q_rows = rows.view(r, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [R, H, T, D]
        k_rows, v_rows = (_gather_pages(store, group.tables, length) for store in (keys, values))  # [R, KVH, L, D]
        # Measured here, this beats torch's fused CPU attention kernel at every shape we run.
        out = _grouped_attention(q_rows, k_rows, v_rows, mask, cfg.num_queries_per_kv, scale)  # [R, H, T, D]
        out = out.transpose(1, 2).reshape(r * t, cfg.num_heads * cfg.head_dim)  # [R*T, H*D]
        return out if group.is_identity else out[group.real]


class _Window:
    """What attention needs for one window width in one step: each row's first position (native kernel) or masks."""

    def __init__(self, firsts: torch.Tensor | None, masks: list[torch.Tensor | None]) -> None:
        self.firsts = firsts  # [N] or None (no window)
        self.masks = masks  # per attention group: [R, 1, T, L] additive, or None


class _Windows:
    """Built once per step and window width: sliding layers share them."""

    def __init__(self, batch: StepBatch, dtype: torch.dtype) -> None:
        self._batch = batch
        self._dtype = dtype
        self._built: dict[int | None, _Window] = {}

    def of(self, width: int | None) -> _Window:
        if width not in self._built:
            self._built[width] = self._build(width)
        return self._built[width]

    def _build(self, width: int | None) -> _Window:
        batch = self._batch
        plain = [None if g.mask is None else g.mask.to(self._dtype) for g in batch.groups]
        if width is None:
            return _Window(None, plain)
        # A row at position p sees positions p - width + 1 .. p; a tree node's ancestors lie within its
        # depth, so only the standing positions it attends can fall out of the window.
        firsts = (batch.positions - (width - 1)).clamp_(min=0)
        if batch.extra is not None and bool((firsts > batch.attended_to + 1).any()):
            raise ValueError(f"a token tree deeper than the model's sliding window ({width} positions)")
        if batch.all_rows_in_kernel:
            return _Window(firsts, plain)
        masks: list[torch.Tensor | None] = []
        for group, mask in zip(batch.groups, plain):
            padded_firsts = firsts[group.query_rows].view(group.num_rows, 1, group.num_query_tokens, 1)
            outside = torch.arange(group.kv_len, device=firsts.device).view(1, 1, 1, -1) < padded_firsts  # [R, 1, T, L]
            window = torch.zeros(outside.shape, dtype=self._dtype, device=firsts.device).masked_fill_(outside, float("-inf"))
            masks.append(window if mask is None else mask + window)
        return _Window(firsts, masks)


def _native_attend(native: ModuleType, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch,
                   scale: float, firsts: torch.Tensor | None) -> torch.Tensor:
    """The attention kernel over rows that attend to positions firsts (or 0) .. ends, and then, where given, to their
    `extra` ones."""
    if batch.extra is None:
        return native.attend(q, keys, values, batch.tables, batch.row_tables, batch.attended_to, scale, firsts)
    return native.attend_tree(q, keys, values, batch.tables, batch.row_tables, batch.attended_to, batch.extra, scale,
                              firsts)


def _gather_pages(store: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0 .. length-1 of each row's pages `[R, W]` as one block per row: `[R, KVH, length, D]` (a copy:
    torch's batched matmul reads a batch as whole matrices; the native kernel reads pages in place)."""
    r, width = tables.shape
    _, kvh, page_size, d = store.shape
    pages = store[tables.reshape(-1)].view(r, width, kvh, page_size, d)
    return pages.transpose(1, 2).reshape(r, kvh, width * page_size, d)[:, :, :length]


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, g: int,
                       scale: float) -> torch.Tensor:
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's: weight * round(x / rms(x)). A float32 weight for a narrower x is Gemma's: round(x / rms(x) * weight)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and dtype != torch.float32:
        return (x32 * weight).to(dtype)
    return weight * x32.to(dtype)


def read_safetensors(folder: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors (all, or those named) of a model folder's weight files, as stored."""
    files = WeightFiles(folder)
    return {name: files.read(name) for name in sorted(files.names()) if names is None or name in names}


def rope_tables(cfg: ModelConfig, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin `[length, head_dim]` of the full-attention layers' RoPE, for positions 0..length-1."""
    return rope_tables_of(cfg.global_rope, cfg.head_dim, length, device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in HF's rotate-half layout: x `[..., D]` with cos/sin broadcast to it (here `[N, 1, D]`)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TensorSource(Protocol):
    """Named tensors to read from: a model folder's weight files (modeling/model/weights.py) or tensors in memory."""

    def names(self) -> frozenset[str]: ...
    def shape(self, name: str) -> tuple[int, ...]: ...
    def read_into(self, name: str, out: torch.Tensor) -> None: ...


class TensorDict:
    """Tensors already in memory, read like weight files."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors = tensors

    def names(self) -> frozenset[str]:
        return frozenset(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        out.copy_(self._tensors[name])


# Tensors some checkpoints carry that the math does not read.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def projection_parts(layer: int) -> dict[str, list[str]]:
    """A layer's fused projections (DecoderLayer's attributes) -> the Hugging Face names of their parts, in row order."""
    return {attr: [f"model.layers.{layer}.{part}" for part in parts] for attr, parts in PROJECTION_PARTS.items()}


def head_parts(config: ModelConfig) -> list[str]:
    """The Hugging Face name of the LM head's weight (the embeddings', when tied)."""
    return ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]


def copy_hf_weights(model: LlamaModel, source: TensorSource | dict[str, torch.Tensor], skip: Collection[str] = ()) -> None:
    """Read every weight the config implies, under its Hugging Face name, into the model's (fused) parameters.

    A missing or misshapen tensor, or one the config does not account for (a bias the config
    does not declare, say), is a WeightError naming it: nothing is served on weights it ignores.
    """
    tensors = TensorDict(source) if isinstance(source, dict) else source
    cfg = model.config
    available = tensors.names()
    used: set[str] = set()

    def put(param: torch.Tensor, parts: list[str], *, plus_one: bool = False) -> None:
        """Read the named tensors, stacked along rows, into `param` (its rows in order)."""
        if parts and all(name in skip and name in available for name in parts):
            used.update(parts)
            return
        row = 0
        for name in parts:
            if name not in available:
                raise WeightError(f"weight {name!r} is missing")
            shape = tensors.shape(name)
            rows = shape[0] if shape else 0
            if tuple(shape[1:]) != tuple(param.shape[1:]) or row + rows > param.shape[0]:
                raise WeightError(f"weight {name!r} has shape {tuple(shape)}, the config implies "
                                  f"{(param.shape[0] - row, *param.shape[1:]) if len(parts) == 1 else tuple(param.shape)} "
                                  f"for {'it' if len(parts) == 1 else 'the fused ' + ', '.join(parts)}")
            target = param[row : row + rows]
            if plus_one:  # Gemma's norm weights: applied as 1 + w, computed in float32 as transformers does
                staged = torch.empty(target.shape, dtype=torch.float32, device=target.device)
                tensors.read_into(name, staged)
                target.copy_(staged + 1.0)
            else:
                tensors.read_into(name, target)
            used.add(name)
            row += rows
        if row != param.shape[0]:
            raise WeightError(f"weights {parts} have {row} rows, the config implies {param.shape[0]}")

    gemma = cfg.gemma
    with torch.no_grad():
        put(model.embed_tokens, ["model.embed_tokens.weight"])
        put(model.norm, ["model.norm.weight"], plus_one=gemma)
        if not cfg.tie_word_embeddings:
            put(model.lm_head, ["lm_head.weight"])
        elif "lm_head.weight" in available:
            used.add("lm_head.weight")  # a tied model's saved copy of its embeddings: transformers ignores it too
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            put(layer.input_norm, [p + "input_layernorm.weight"], plus_one=gemma)
            put(layer.post_attention_norm, [p + "post_attention_layernorm.weight"], plus_one=gemma)
            if layer.pre_mlp_norm is not None and layer.post_mlp_norm is not None:
                put(layer.pre_mlp_norm, [p + "pre_feedforward_layernorm.weight"], plus_one=True)
                put(layer.post_mlp_norm, [p + "post_feedforward_layernorm.weight"], plus_one=True)
            projections = projection_parts(i)
            put(layer.qkv_proj, projections["qkv_proj"])
            if layer.qkv_bias is not None:
                put(layer.qkv_bias, [p + f"self_attn.{n}_proj.bias" for n in "qkv"])
            if layer.q_norm is not None and layer.k_norm is not None:
                put(layer.q_norm, [p + "self_attn.q_norm.weight"], plus_one=gemma)
                put(layer.k_norm, [p + "self_attn.k_norm.weight"], plus_one=gemma)
            put(layer.o_proj, projections["o_proj"])
            if layer.o_bias is not None:
                put(layer.o_bias, [p + "self_attn.o_proj.bias"])
            put(layer.gate_up_proj, projections["gate_up_proj"])
            if layer.gate_up_bias is not None:
                put(layer.gate_up_bias, [p + "mlp.gate_proj.bias", p + "mlp.up_proj.bias"])
            put(layer.down_proj, projections["down_proj"])
            if layer.down_bias is not None:
                put(layer.down_bias, [p + "mlp.down_proj.bias"])
    unused = sorted(name for name in available - used if not name.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise WeightError(f"weight {unused[0]!r} is not part of the model config.json describes (unused weights: "
                          f"{unused[:5]}{' ...' if len(unused) > 5 else ''})")
