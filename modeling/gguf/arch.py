"""What each GGUF architecture this converter knows becomes in transformers: its config.json and its tensor names.

llama.cpp writes a model's hyperparameters as `{arch}.*` metadata keys; here they become
the config dict the installed transformers' own config class writes (transformers 5's
spelling: `rope_parameters`, `dtype`). The GGUF architectures and what they become:

- `llama`: LlamaForCausalLM, or MistralForCausalLM when the file gives a sliding window
  (llama.cpp writes Mistral models as llama). llama.cpp permuted the q/k rows of this
  architecture only (`unpermute_rope_rows`). A Llama 3.1-style `rope_freqs.weight` becomes
  the `llama3` RoPE scaling that reproduces it (modeling/gguf/rope.py).
- `qwen2`: Qwen2ForCausalLM, with q/k/v biases.
- `qwen3`: Qwen3ForCausalLM, with RMS norms on each head's queries and keys.
- `gemma3`: Gemma3ForCausalLM (model_type gemma3_text), four norms a layer and query/key norms, stored by
  llama.cpp as w + 1 and written back as w (what transformers' GGUF loader does too).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from modeling.gguf.metadata import GgufConversionError, GgufMetadata
from modeling.gguf.rope import llama3_rope_scaling

ROPE_FREQS_TENSOR = "rope_freqs.weight"
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_ATTENTION = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
}
_MLP = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORMS = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **_ATTENTION,
    **_MLP,
}
_QKV_BIASES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}
_GEMMA3_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    **_ATTENTION,
    **_QK_NORMS,
    **_MLP,
}


ConfigBuilder = Callable[[GgufMetadata, dict[str, Any], int, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture becomes a transformers model: its config and its tensors."""

    config: ConfigBuilder  # (metadata, the keys every family has, head_dim, rope_parameters) -> config.json
    layer_tensors: Mapping[str, str]  # the GGUF name after `blk.N.` -> the transformers name after `model.layers.N.`
    rope_rows_permuted: bool = False  # llama.cpp interleaved each q/k head's rows for its RoPE kernel
    norms_plus_one: bool = False  # norm weights stored as w + 1 (Gemma's RMSNorm multiplies by 1 + w)


_GEMMA3_LOCAL_THETA = 10000.0  # the sliding layers' RoPE base, unless the file gives rope.freq_base_swa
_GEMMA3_PATTERN = 6  # every 6th layer attends globally when the file gives no pattern (llama.cpp's default)
_GEMMA3_27B_LAYERS = 62  # llama.cpp scales Gemma 3 27B's queries by hidden_size / heads, every other by head_dim


def architecture(metadata: GgufMetadata) -> Architecture:
    arch = metadata.arch
    if arch not in ARCHITECTURES:
        raise GgufConversionError(
            f"general.architecture {arch!r} is not supported (supported: {sorted(ARCHITECTURES)})"
        )
    return ARCHITECTURES[arch]


def hf_config(metadata: GgufMetadata, tensor_names: Collection[str], rope_freqs: np.ndarray | None) -> dict[str, Any]:
    """The config.json dict of the model the metadata describes; `rope_freqs`: the file's rope_freqs.weight, if any."""
    layout = architecture(metadata)
    if rope_freqs is not None and metadata.arch != "llama":
        raise GgufConversionError(f"GGUF tensor {ROPE_FREQS_TENSOR!r} is only understood for architecture 'llama'")
    common = _common_config(metadata, tensor_names)
    head_dim = _head_dim(metadata, common["hidden_size"] // common["num_attention_heads"])
    rope = _rope_parameters(metadata, head_dim, rope_freqs)
    return layout.config(metadata, common, head_dim, rope)


def _llama_config(
    metadata: GgufMetadata, common: dict[str, Any], head_dim: int, rope: dict[str, Any]
) -> dict[str, Any]:
    window = metadata.model_get("attention.sliding_window")
    if window is None:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **common,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "rope_parameters": rope,
        }
    return {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        **common,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "sliding_window": int(window),
        "rope_parameters": rope,
    }


def _qwen2_config(
    metadata: GgufMetadata, common: dict[str, Any], head_dim: int, rope: dict[str, Any]
) -> dict[str, Any]:
    if head_dim != common["hidden_size"] // common["num_attention_heads"]:
        raise GgufConversionError(f"qwen2 head width {head_dim} is not hidden_size / heads, as Qwen2 has it")
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **common,
        "hidden_act": "silu",
        "use_sliding_window": False,
        "rope_parameters": rope,
    }


def _qwen3_config(
    metadata: GgufMetadata, common: dict[str, Any], head_dim: int, rope: dict[str, Any]
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **common,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "rope_parameters": rope,
    }


def _common_config(metadata: GgufMetadata, tensor_names: Collection[str]) -> dict[str, Any]:
    num_heads = _count(metadata, "attention.head_count")
    tokens = metadata.require("tokenizer.ggml.tokens")
    return {
        "vocab_size": int(metadata.model_get("vocab_size", len(tokens))),
        "hidden_size": _count(metadata, "embedding_length"),
        "intermediate_size": _count(metadata, "feed_forward_length"),
        "num_hidden_layers": _count(metadata, "block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _count(metadata, "attention.head_count_kv", default=num_heads),
        "rms_norm_eps": float(metadata.model_require("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": _count(metadata, "context_length"),
        # llama.cpp writes the output projection only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "dtype": "float32",
    }


def _count(metadata: GgufMetadata, name: str, default: int | None = None) -> int:
    """A per-model count; llama.cpp writes some as one value per layer, which only a uniform model may have here."""
    value = metadata.model_get(name, default) if default is not None else metadata.model_require(name)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise GgufConversionError(f"{metadata.arch}.{name} differs between layers ({value[:8]}...)")
        value = value[0]
    return int(value)


def _head_dim(metadata: GgufMetadata, default: int) -> int:
    """The head width: key_length, value_length and the rotated width must agree (no partial RoPE here)."""
    widths = {
        name: metadata.model_get(name)
        for name in ("attention.key_length", "attention.value_length", "rope.dimension_count")
    }
    given = {name: int(width) for name, width in widths.items() if width is not None}
    if len(set(given.values())) > 1:
        raise GgufConversionError(
            f"{metadata.arch} head widths disagree: {given} (partial RoPE or unequal key and "
            "value widths are not supported)"
        )
    return next(iter(given.values()), default)


def _rope_parameters(metadata: GgufMetadata, head_dim: int, rope_freqs: np.ndarray | None) -> dict[str, Any]:
    theta = float(metadata.model_get("rope.freq_base", 10000.0))
    scaling = _metadata_rope_scaling(metadata)
    if rope_freqs is not None:
        if scaling is not None:
            raise GgufConversionError(
                f"GGUF has both {ROPE_FREQS_TENSOR!r} and {metadata.arch}.rope.scaling.type "
                f"{scaling['rope_type']!r}; one RoPE scaling at a time is supported"
            )
        scaling = llama3_rope_scaling(rope_freqs, theta, head_dim, tensor_name=ROPE_FREQS_TENSOR)
    return {"rope_type": "default", "rope_theta": theta} if scaling is None else {"rope_theta": theta, **scaling}


def _metadata_rope_scaling(metadata: GgufMetadata) -> dict[str, Any] | None:
    """`{arch}.rope.scaling.*` as transformers' rope parameters; keys not read here are refused by the caller."""
    metadata.model_get("rope.scaling.finetuned")  # whether the model was trained with it: changes nothing here
    kind = metadata.model_get("rope.scaling.type", "none")
    linear = metadata.model_get("rope.scale_linear")  # older files' spelling of a linear factor
    if kind == "none" and linear is not None and float(linear) != 1.0:
        return {"rope_type": "linear", "factor": float(linear)}
    if kind == "none":
        return None
    factor = float(metadata.model_require("rope.scaling.factor"))
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        yarn = {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": int(metadata.model_require("rope.scaling.original_context_length")),
        }
        for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := metadata.model_get(f"rope.scaling.{gguf_name}")) is not None:
                yarn[hf_name] = float(value)
        return yarn
    raise GgufConversionError(f"{metadata.arch}.rope.scaling.type {kind!r} is not supported (none, linear or yarn)")


def _gemma3_config(
    metadata: GgufMetadata, common: dict[str, Any], head_dim: int, rope: dict[str, Any]
) -> dict[str, Any]:
    num_layers = common["num_hidden_layers"]
    window = metadata.model_get("attention.sliding_window")
    local_theta = float(metadata.model_get("rope.freq_base_swa", _GEMMA3_LOCAL_THETA))
    query_scalar = (
        common["hidden_size"] // common["num_attention_heads"] if num_layers == _GEMMA3_27B_LAYERS else head_dim
    )
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        **common,
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_scalar,
        "sliding_window": None if window is None else int(window),
        "layer_types": [
            "sliding_attention" if sliding else "full_attention"
            for sliding in _gemma3_sliding_layers(metadata, num_layers)
        ],
        # Only the global layers take the file's base and scaling; the sliding ones keep plain RoPE at their own base.
        "rope_parameters": {
            "full_attention": rope,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
    }


def _gemma3_sliding_layers(metadata: GgufMetadata, num_layers: int) -> list[bool]:
    """Per layer, whether it attends through the sliding window: the pattern's period, or one flag per layer."""
    pattern = metadata.model_get("attention.sliding_window_pattern", _GEMMA3_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise GgufConversionError(
                f"gemma3.attention.sliding_window_pattern has {len(pattern)} flags for {num_layers} layers"
            )
        return [bool(flag) for flag in pattern]
    period = int(pattern)
    if period < 1:
        raise GgufConversionError(f"gemma3.attention.sliding_window_pattern {period} is not a period")
    return [(layer + 1) % period != 0 for layer in range(num_layers)]


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(_llama_config, _LLAMA_LAYER, rope_rows_permuted=True),
    "qwen2": Architecture(_qwen2_config, {**_LLAMA_LAYER, **_QKV_BIASES}),
    "qwen3": Architecture(_qwen3_config, {**_LLAMA_LAYER, **_QK_NORMS}),
    "gemma3": Architecture(_gemma3_config, _GEMMA3_LAYER, norms_plus_one=True),
}
