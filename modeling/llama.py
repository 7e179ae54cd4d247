"""The Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) over packed ragged batches and a paged KV cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from safetensors import safe_open

from modeling.batch import AttentionGroup, SeqSpan, StepBatch, build_step_batch
from modeling.config import ModelConfig
from modeling.kv_cache import KVCache


class WeightError(ValueError):
    """The weight files do not match the config (a missing or misshapen tensor)."""


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.qkv_sizes = (q_size, kv_size, kv_size)
        self.input_norm = torch.nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.qkv_proj = torch.nn.Parameter(torch.empty(q_size + 2 * kv_size, config.hidden_size), requires_grad=False)
        self.qkv_bias = torch.nn.Parameter(torch.zeros(q_size + 2 * kv_size), requires_grad=False) if config.attention_bias else None
        self.o_proj = torch.nn.Parameter(torch.empty(config.hidden_size, q_size), requires_grad=False)
        self.post_attention_norm = torch.nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.gate_up_proj = torch.nn.Parameter(torch.empty(2 * config.intermediate_size, config.hidden_size), requires_grad=False)
        self.down_proj = torch.nn.Parameter(torch.empty(config.hidden_size, config.intermediate_size), requires_grad=False)


class LlamaModel(torch.nn.Module):
    """Scores the new tokens of a step; `forward` returns the hidden states of `logit_rows`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = torch.nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        self.layers: list[DecoderLayer] = torch.nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))  # type: ignore[assignment]
        self.norm = torch.nn.Parameter(torch.ones(config.hidden_size), requires_grad=False)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else torch.nn.Parameter(torch.empty(config.vocab_size, config.hidden_size), requires_grad=False)
        )
        # y = x @ W^T (+ b); a built model may swap in a faster kernel (see cpu_kernels.py).
        self.linear: Callable[..., torch.Tensor] = F.linear
        # The native CPU kernels (modeling/native.py), when the built model has them: fused
        # norms, RoPE and SiLU, and attention of decode and verify rows over the cache in
        # place. Without them, torch ops do all of it.
        self.native: ModuleType | None = None
        self._rope_cos: torch.Tensor | None = None  # [max_len, head_dim], built by set_rope_cache
        self._rope_sin: torch.Tensor | None = None

    # ------------------------------------------------------------------ building

    def load_weights(self, folder: Path) -> None:
        """Read every *.safetensors file in `folder` (HF names) into the fused parameters."""
        copy_hf_weights(self, read_safetensors(folder))

    def set_rope_cache(self, max_len: int) -> None:
        """Precompute cos/sin for positions 0..max_len-1 exactly as HF does (fp32, then cast)."""
        cos, sin = rope_tables(self.config, max_len, self.embed_tokens.device)
        self._rope_cos = cos.to(self.embed_tokens.dtype)
        self._rope_sin = sin.to(self.embed_tokens.dtype)

    # ------------------------------------------------------------------ forward

    def plan(self, spans: list[SeqSpan], page_size: int) -> StepBatch:
        """The step's packed batch, its attention planned for this model's kernels; raises PageError on a short block table."""
        return build_step_batch(spans, self.embed_tokens.device, page_size, rows_in_kernel=self.native is not None)

    def forward(self, batch: StepBatch, cache: KVCache, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Append the batch's tokens to the cache and return the final (normed) hidden states of every row `[N, hidden]`.

        `inputs` `[N, hidden]` replaces the token embeddings (a draft head feeds its own mix).
        """
        if self._rope_cos is None or self._rope_sin is None:
            raise RuntimeError("set_rope_cache() must run before forward()")
        cos = self._rope_cos[batch.positions]  # [N, D]
        sin = self._rope_sin[batch.positions]
        masks = [None if g.mask is None else g.mask.to(self.embed_tokens.dtype) for g in batch.groups]
        # [N, hidden], this pass's own copy: the native norms add to it in place
        x = F.embedding(batch.token_ids, self.embed_tokens) if inputs is None else inputs.clone(memory_format=torch.contiguous_format)
        h = self._norm(x, self.layers[0].input_norm)
        for index, layer in enumerate(self.layers):
            x, h = self._add_norm(x, self._attention(index, layer, h, cos, sin, batch, masks, cache), layer.post_attention_norm)
            mlp = self.linear(self._silu_mul(self.linear(h, layer.gate_up_proj)), layer.down_proj)
            following = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.norm
            x, h = self._add_norm(x, mlp, following)
        return h

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

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.native is not None:
            return self.native.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[M, hidden]` -> float32 logits `[M, vocab]`."""
        return self.linear(hidden, self.lm_head).float()

    def _attention(
        self,
        index: int,
        layer: DecoderLayer,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: StepBatch,
        masks: list[torch.Tensor | None],
        cache: KVCache,
    ) -> torch.Tensor:
        cfg = self.config
        n = h.shape[0]
        q_size, kv_size = layer.qkv_sizes[0], layer.qkv_sizes[1]
        qkv = self.linear(h, layer.qkv_proj, layer.qkv_bias)  # [N, (H + 2*KVH) * D]
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
        scale = cfg.head_dim**-0.5
        if native is not None and batch.all_rows_in_kernel:
            attended = _native_attend(native, q, keys, values, batch, scale)
            return self.linear(attended, layer.o_proj)
        if len(batch.groups) == 1 and batch.groups[0].is_identity:
            return self.linear(self._group_attention(batch.groups[0], masks[0], q, keys, values), layer.o_proj)
        out = torch.empty(n, cfg.num_heads * cfg.head_dim, dtype=h.dtype, device=h.device)  # [N, H*D]
        for group, mask in zip(batch.groups, masks):
            out[group.real_rows] = self._group_attention(group, mask, q, keys, values)
        return self.linear(out, layer.o_proj)

    def _group_attention(
        self, group: AttentionGroup, mask: torch.Tensor | None, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> torch.Tensor:
        """Attention of one group's real queries: returns `[K, H*D]` aligned with group.real_rows."""
        cfg = self.config
        r, t, length = group.num_rows, group.num_query_tokens, group.kv_len
        rows = q if group.is_identity else q[group.query_rows]  # [R*T, H, D]
        q_rows = rows.view(r, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [R, H, T, D]
        k_rows, v_rows = (_gather_pages(store, group.tables, length) for store in (keys, values))  # [R, KVH, L, D]
        # Measured here, this beats torch's fused CPU attention kernel at every shape we run.
        out = _grouped_attention(q_rows, k_rows, v_rows, mask, cfg.num_queries_per_kv)  # [R, H, T, D]
        out = out.transpose(1, 2).reshape(r * t, cfg.num_heads * cfg.head_dim)  # [R*T, H*D]
        return out if group.is_identity else out[group.real]


def _native_attend(native: ModuleType, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: StepBatch,
                   scale: float) -> torch.Tensor:
    """The attention kernel over rows that attend to positions 0..ends, and then, where given, to their `extra` ones."""
    if batch.extra is None:
        return native.attend(q, keys, values, batch.tables, batch.row_tables, batch.attended_to, scale)
    return native.attend_tree(q, keys, values, batch.tables, batch.row_tables, batch.attended_to, batch.extra, scale)


def _gather_pages(store: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0 .. length-1 of each row's pages `[R, W]` as one block per row: `[R, KVH, length, D]` (a copy:
    torch's batched matmul reads a batch as whole matrices; the native kernel reads pages in place)."""
    r, width = tables.shape
    _, kvh, page_size, d = store.shape
    pages = store[tables.reshape(-1)].view(r, width, kvh, page_size, d)
    return pages.transpose(1, 2).reshape(r, kvh, width * page_size, d)[:, :, :length]


def _grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, g: int) -> torch.Tensor:
    """Softmax attention, q `[R, H, T, D]` over k, v `[R, KVH, L, D]` with H = KVH * G -> `[R, H, T, D]`.

    k and v are each row's keys and values in one block (gathered from its pages).
    """
    r, h, t, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    qg = q.reshape(r * kvh, g * t, d)  # heads split as [KVH, G]: the G query heads of a kv head, stacked
    keys, values = k.reshape(r * kvh, length, d), v.reshape(r * kvh, length, d)
    # Scores as keys @ queries^T: on CPU, bf16 batched matmul is ~25% faster with the cache's
    # rows as the left operand; turned back to [R*KVH, G*T, L] so softmax runs along memory.
    scores = torch.bmm(keys, qg.transpose(1, 2)).transpose(1, 2).float() * (d**-0.5)  # [R*KVH, G*T, L]
    if mask is not None:  # [R, 1, T, L], the same for the G heads of each kv head
        scores = scores.view(r, kvh, g, t, length).add_(mask.unsqueeze(1)).view(r * kvh, g * t, length)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.bmm(probs, values).view(r, h, t, d)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def read_safetensors(folder: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors (all, or those named) of every *.safetensors file in `folder`."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightError(f"no *.safetensors file in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if names is None or name in names:
                    tensors[name] = f.get_tensor(name)
    return tensors


def rope_tables(cfg: ModelConfig, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin `[length, head_dim]` for positions 0..length-1."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).float() / cfg.head_dim))
    freqs = torch.outer(torch.arange(length, device=device).float(), inv_freq)  # [L, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in HF's rotate-half layout: x `[..., D]` with cos/sin broadcast to it (here `[N, 1, D]`)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def copy_hf_weights(model: LlamaModel, tensors: dict[str, torch.Tensor]) -> None:
    cfg = model.config

    def take(name: str) -> torch.Tensor:
        try:
            return tensors[name]
        except KeyError as exc:
            raise WeightError(f"weight {name!r} is missing") from exc

    def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
        if param.shape != value.shape:
            raise WeightError(f"weight {name!r} has shape {tuple(value.shape)}, the config implies {tuple(param.shape)}")
        param.copy_(value)

    with torch.no_grad():
        put(model.embed_tokens, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(model.norm, take("model.norm.weight"), "model.norm.weight")
        if not cfg.tie_word_embeddings:
            put(model.lm_head, take("lm_head.weight"), "lm_head.weight")
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            put(layer.input_norm, take(p + "input_layernorm.weight"), p + "input_layernorm.weight")
            put(layer.post_attention_norm, take(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm.weight")
            qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
            put(layer.qkv_proj, qkv, p + "self_attn.qkv_proj")
            if layer.qkv_bias is not None:
                put(layer.qkv_bias, torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]), p + "self_attn.qkv_bias")
            put(layer.o_proj, take(p + "self_attn.o_proj.weight"), p + "self_attn.o_proj.weight")
            gate_up = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            put(layer.gate_up_proj, gate_up, p + "mlp.gate_up_proj")
            put(layer.down_proj, take(p + "mlp.down_proj.weight"), p + "mlp.down_proj.weight")
