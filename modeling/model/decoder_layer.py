"""One decoder layer's parameters, and how the decoder allocates every parameter it holds.

Their shapes, dtypes and places are one concept apart from the forward: a layer holds its
fused projections (modeling/model/checkpoint.py names their parts), biases and norms as its
config's switches ask; the matmul weights lie in the model's region of huge pages
(modeling/kernels/huge_pages.py), the rest in the serving dtype on the serving device.
"""

from __future__ import annotations

import torch

from modeling.kernels.huge_pages import HugePageRegion
from modeling.model.config import ModelConfig


def frozen_parameter(
    *shape: int, dtype: torch.dtype, device: torch.device, fill: float | None = None
) -> torch.nn.Parameter:
    """A frozen parameter, allocated in the serving dtype and device (uninitialised unless `fill`)."""
    data = (
        torch.empty(shape, dtype=dtype, device=device)
        if fill is None
        else torch.full(shape, fill, dtype=dtype, device=device)
    )
    return torch.nn.Parameter(data, requires_grad=False)


def matmul_weight(region: HugePageRegion, *shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    """A frozen, uninitialised matmul weight in `region`'s next place (a plain tensor off the CPU)."""
    return torch.nn.Parameter(region.empty(shape, dtype), requires_grad=False)


def _projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """A layer's fused projections (PROJECTION_PARTS' keys, in that order) -> their weights' [out, in] shapes."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inner = config.hidden_size, config.intermediate_size
    return {
        "qkv_proj": (q_size + 2 * kv_size, hidden),
        "o_proj": (hidden, q_size),
        "gate_up_proj": (2 * inner, hidden),
        "down_proj": (hidden, inner),
    }


def weight_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """The shapes of the matmul weights DecoderModel allocates, in the order it allocates them: the embeddings, each
    layer's projections, and an untied LM head."""
    head = [] if config.tie_word_embeddings else [(config.vocab_size, config.hidden_size)]
    layer = list(_projection_shapes(config).values())
    return [(config.vocab_size, config.hidden_size), *layer * config.num_layers, *head]


def norm_dtype(config: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """Gemma applies its norms in float32 (x * (1 + w), rounded once), so its weights stay float32;
    others' are in dtype."""
    return torch.float32 if config.gemma else dtype


class DecoderLayer(torch.nn.Module):
    """One layer's parameters, as its config's switches ask (DecoderModel runs the layer's forward)."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device, weights: HugePageRegion) -> None:
        super().__init__()
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        hidden, inner = config.hidden_size, config.intermediate_size
        self.qkv_sizes = (q_size, kv_size, kv_size)

        def param(*shape: int, fill: float | None = None) -> torch.nn.Parameter:
            return frozen_parameter(*shape, dtype=dtype, device=device, fill=fill)

        def bias(size: int, wanted: bool) -> torch.nn.Parameter | None:
            return param(size, fill=0.0) if wanted else None

        shapes = _projection_shapes(config)

        def weight(name: str) -> torch.nn.Parameter:
            return matmul_weight(weights, *shapes[name], dtype=dtype)

        def norm(size: int) -> torch.nn.Parameter:
            return frozen_parameter(size, dtype=norm_dtype(config, dtype), device=device, fill=1.0)

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
