"""A Hugging Face checkpoint read into the decoder's parameters: each parameter's names there, and the copy.

The decoder fuses projections (q, k and v in one weight; gate and up in another), so one of
its parameters is read from several of the checkpoint's tensors, stacked by rows. Every
tensor the config implies must be there with its shape, and every tensor there must be used.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from modeling.model.config import ModelConfig
from modeling.model.weights import WeightError, WeightFiles

if TYPE_CHECKING:
    from modeling.model.decoder import DecoderModel

# A layer's projections as the model fuses them -> the transformers names of their parts, in row order.
PROJECTION_PARTS = {
    "qkv_proj": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o_proj": ("self_attn.o_proj.weight",),
    "gate_up_proj": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down_proj": ("mlp.down_proj.weight",),
}


def read_safetensors(folder: Path, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors (all, or those named) of a model folder's weight files, as stored."""
    files = WeightFiles(folder)
    return {name: files.read(name) for name in sorted(files.names()) if names is None or name in names}


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
    """A layer's fused projections (DecoderLayer's attributes)
    -> the Hugging Face names of their parts, in row order."""
    return {attr: [f"model.layers.{layer}.{part}" for part in parts] for attr, parts in PROJECTION_PARTS.items()}


def head_parts(config: ModelConfig) -> list[str]:
    """The Hugging Face name of the LM head's weight (the embeddings', when tied)."""
    return ["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]


def copy_hf_weights(
    model: DecoderModel, source: TensorSource | dict[str, torch.Tensor], skip: Collection[str] = ()
) -> None:
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
                raise WeightError(
                    f"weight {name!r} has shape {tuple(shape)}, the config implies "
                    f"{(param.shape[0] - row, *param.shape[1:]) if len(parts) == 1 else tuple(param.shape)} "
                    f"for {'it' if len(parts) == 1 else 'the fused ' + ', '.join(parts)}"
                )
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
        raise WeightError(
            f"weight {unused[0]!r} is not part of the model config.json describes (unused weights: "
            f"{unused[:5]}{' ...' if len(unused) > 5 else ''})"
        )
