"""The decoder of every supported family (RMSNorm, RoPE, GQA, a gated MLP)
over packed ragged batches and a paged KV cache.

One model code runs Llama, Mistral, Qwen2/3 and Gemma 3: the differences are switches of
`ModelConfig` (modeling/model/config.py) — biases, query/key norms, sliding windows per layer,
a RoPE per layer, and Gemma's sandwich norms, embedding scale and GELU-tanh MLP.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from modeling.kernels.huge_pages import HugePageRegion
from modeling.model.attention import Window, Windows, gather_pages, grouped_attention, native_attend
from modeling.model.batch import AttentionGroup, SeqSpan, StepBatch, build_step_batch
from modeling.model.checkpoint import copy_hf_weights
from modeling.model.config import ModelConfig
from modeling.model.decoder_layer import DecoderLayer, frozen_parameter, matmul_weight, norm_dtype, weight_shapes
from modeling.model.kv_cache import KVCache
from modeling.model.rope import Rope, apply_rope
from modeling.model.rope import rope_tables as rope_tables_of
from modeling.model.weights import WeightFiles


@dataclass(frozen=True)
class ForwardOps:
    """What a model's forward runs on, fixed when it is built (modeling/kernels/packing.py chooses).

    Torch's ops alone; or the native CPU kernels: `linear` their packed matmul (the model's
    weights are packed for it once loaded, `pack_weights`), `native` their module of fused
    norms, RoPE, SiLU and attention over the cache in place. On the native kernels, a model
    whose family they cover whole also runs its layers as one native call (`fuse_layers`).
    """

    linear: Callable[..., torch.Tensor] = F.linear  # y = x @ W^T (+ b)
    native: ModuleType | None = None
    said: str = "torch"  # which ops, and why, for the owner's log


TORCH_OPS = ForwardOps()


class DecoderModel(torch.nn.Module):
    """Scores the new tokens of a step; `forward` returns the hidden states of `logit_rows`.

    Parameters are allocated in `dtype` on `device` and the weights read straight into them;
    on the CPU the matmul weights (embeddings, projections, LM head) lie in one region of huge
    pages (modeling/kernels/huge_pages.py), each at a page boundary.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        ops: ForwardOps = TORCH_OPS,
    ) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        device = torch.device(device)
        self._weights = HugePageRegion([rows * cols * dtype.itemsize for rows, cols in weight_shapes(config)], device)
        self.embed_tokens = matmul_weight(self._weights, config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers: list[DecoderLayer] = torch.nn.ModuleList(  # type: ignore[assignment]
            DecoderLayer(config, dtype, device, self._weights) for _ in range(config.num_layers)
        )
        self.norm = frozen_parameter(config.hidden_size, dtype=norm_dtype(config, dtype), device=device, fill=1.0)
        self.lm_head = (
            self.embed_tokens
            if config.tie_word_embeddings
            else matmul_weight(self._weights, config.vocab_size, config.hidden_size, dtype=dtype)
        )
        self.linear = ops.linear
        self.native = ops.native
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
        """The step's packed batch, its attention planned for this model's kernels;
        raises PageError on a short block table."""
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
            for weight, bias in (
                (layer.qkv_proj, layer.qkv_bias),
                (layer.o_proj, layer.o_bias),
                (layer.gate_up_proj, layer.gate_up_bias),
                (layer.down_proj, layer.down_bias),
            ):
                outputs, block_format = projection(weight)
                packed.append(weight)
                num_out.append(outputs)
                formats.append(block_format)
                biases.append(bias)
            following = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.norm
            norms += [layer.post_attention_norm, following]
        windows = [self._window_widths.index(width) for width in self._windows]
        self.fused_layers = self.native.DecoderStack(
            packed,
            num_out,
            biases,
            formats,
            norms,
            self._layer_rope,
            windows,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.attention_scale,
            cfg.rms_norm_eps,
            path,
        )
        return True

    def embed_from(self, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Read embeddings through `rows` (ids -> `[N, hidden]`) and free the table: a tied LM head, packed for the
        native kernels, holds the same rows, so one copy of a large vocabulary's table is enough."""
        self._embedding_rows = rows
        table = self.embed_tokens
        self.embed_tokens = torch.nn.Parameter(
            self.embed_tokens.new_empty(0, self.config.hidden_size), requires_grad=False
        )
        if table.data_ptr() != self.lm_head.data_ptr():  # the head is another copy (blocks), not this table packed
            self.release_weight(table)

    def release_weight(self, weight: torch.Tensor) -> None:
        """Free the memory of a matmul weight the model allocated and no longer reads (replaced by another copy)."""
        self._weights.release(weight)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings of `token_ids` `[N]` -> `[N, hidden]` (scaled by sqrt(hidden) for Gemma)."""
        x = (
            F.embedding(token_ids, self.embed_tokens)
            if self._embedding_rows is None
            else self._embedding_rows(token_ids)
        )
        if self.config.gemma:
            x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)
        return x

    def forward(self, batch: StepBatch, cache: KVCache, inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Append the batch's tokens to the cache and return the final (normed) hidden states
        of every row `[N, hidden]`.

        `inputs` `[N, hidden]` replaces the token embeddings (a draft head feeds its own mix).
        """
        if not self._rope_tables:
            raise RuntimeError("set_rope_cache() must run before forward()")
        rotations = [(cos[batch.positions], sin[batch.positions]) for cos, sin in self._rope_tables]  # [N, D] each
        windows = Windows(batch, self.embed_tokens.dtype)
        # [N, hidden], this pass's own copy: the native norms add to it in place
        x = self.embed(batch.token_ids) if inputs is None else inputs.clone(memory_format=torch.contiguous_format)
        h = self._norm(x, self.layers[0].input_norm)
        if self.fused_layers is not None:
            firsts = [windows.of(width).firsts for width in self._window_widths]
            return self.fused_layers.forward(
                x,
                h,
                cache.keys,
                cache.values,
                [cos for cos, _ in rotations],  # type: ignore[no-any-return]
                [sin for _, sin in rotations],
                firsts,
                batch.store_pages,
                batch.store_offsets,
                batch.tables,
                batch.row_tables,
                batch.attended_to,
                batch.extra,
            )
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

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
        if (
            self.native is not None
            and logits.device.type == "cpu"
            and logits.dtype in (torch.float32, torch.bfloat16)
            and logits.dim() == 2
            and logits.size(1) > 0
            and logits.stride(1) == 1
        ):
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
        window: Window,
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
            qk = apply_rope(
                qkv[:, : q_size + kv_size].view(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim),
                cos.unsqueeze(1),
                sin.unsqueeze(1),
            )
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
            attended = native_attend(native, q, keys, values, batch, scale, window.firsts)
            return self.linear(attended, layer.o_proj, layer.o_bias)
        masks = window.masks
        if len(batch.groups) == 1 and batch.groups[0].is_identity:
            out = self._group_attention(batch.groups[0], masks[0], q, keys, values, scale)
            return self.linear(out, layer.o_proj, layer.o_bias)
        out = torch.empty(n, cfg.num_heads * cfg.head_dim, dtype=h.dtype, device=h.device)  # [N, H*D]
        for group, mask in zip(batch.groups, masks):
            out[group.real_rows] = self._group_attention(group, mask, q, keys, values, scale)
        return self.linear(out, layer.o_proj, layer.o_bias)

    def _group_attention(
        self,
        group: AttentionGroup,
        mask: torch.Tensor | None,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention of one group's real queries: returns `[K, H*D]` aligned with group.real_rows."""
        cfg = self.config
        r, t, length = group.num_rows, group.num_query_tokens, group.kv_len
        rows = q if group.is_identity else q[group.query_rows]  # [R*T, H, D]
        q_rows = rows.view(r, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [R, H, T, D]
        k_rows, v_rows = (gather_pages(store, group.tables, length) for store in (keys, values))  # [R, KVH, L, D]
        # Measured here, this beats torch's fused CPU attention kernel at every shape we run.
        out = grouped_attention(q_rows, k_rows, v_rows, mask, cfg.num_queries_per_kv, scale)  # [R, H, T, D]
        out = out.transpose(1, 2).reshape(r * t, cfg.num_heads * cfg.head_dim)  # [R*T, H*D]
        return out if group.is_identity else out[group.real]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's: weight * round(x / rms(x)). A float32 weight for a narrower x is Gemma's: round(x / rms(x) * weight)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if weight.dtype == torch.float32 and dtype != torch.float32:
        return (x32 * weight).to(dtype)
    return weight * x32.to(dtype)
