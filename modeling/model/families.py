"""The model families this code runs, and the config.json keys it knows for each.

A family (a config.json model_type) fixes defaults and switches and names the keys it reads
beyond the common ones; the other keys any config.json may hold are either neutral at one
value (NEUTRAL_KEYS) or metadata that leaves the math alone. modeling/model/config.py reads a
config.json against these tables and refuses any key outside them, since it may change the math.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    """What a model_type fixes, and the config.json keys (beyond the common ones) it reads."""

    keys: frozenset[str]
    activation_key: str = "hidden_act"
    default_activation: str = "silu"
    default_max_positions: int = 2048
    default_head_dim: int | None = None  # None: hidden_size / num_attention_heads
    default_tied: bool = False
    default_theta: float = 10000.0
    qkv_bias: bool = False  # always (Qwen2), else as attention_bias says (which then biases o_proj too)
    qk_norm: bool = False
    gemma: bool = False

    def known_keys(self) -> frozenset[str]:
        """Every config.json key this family's models may have: read, neutral at the values allowed, or metadata."""
        return _COMMON_KEYS | self.keys | {self.activation_key} | set(NEUTRAL_KEYS) | _METADATA_KEYS


_QWEN_WINDOW_KEYS = frozenset({"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"})
FAMILIES: dict[str, Family] = {
    "llama": Family(frozenset({"attention_bias", "mlp_bias", "head_dim"})),
    "mistral": Family(frozenset({"sliding_window", "head_dim"}), default_max_positions=131072),
    "qwen2": Family(_QWEN_WINDOW_KEYS, default_max_positions=32768, qkv_bias=True),
    "qwen3": Family(
        _QWEN_WINDOW_KEYS | {"attention_bias", "head_dim"},
        default_max_positions=32768,
        default_head_dim=128,
        qk_norm=True,
    ),
    "gemma3_text": Family(
        frozenset(
            {
                "attention_bias",
                "head_dim",
                "query_pre_attn_scalar",
                "sliding_window",
                "layer_types",
                "sliding_window_pattern",
                "_sliding_window_pattern",
                "rope_local_base_freq",
                "final_logit_softcapping",
                "attn_logit_softcapping",
                "use_bidirectional_attention",
            }
        ),
        activation_key="hidden_activation",
        default_activation="gelu_pytorch_tanh",
        default_max_positions=131072,
        default_head_dim=256,
        default_tied=True,
        default_theta=1_000_000.0,
        qk_norm=True,
        gemma=True,
    ),
}
ACTIVATIONS = frozenset({"silu", "gelu_pytorch_tanh"})


# The keys every family reads (the rope_* ones as modeling/model/config.py says).
_COMMON_KEYS = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "max_position_embeddings",
        "tie_word_embeddings",
    }
)

# Keys that would change the math, accepted only at the value that leaves it as implemented.
NEUTRAL_KEYS: dict[str, Any] = {
    "rope_interleaved": lambda v: not v,
    "partial_rotary_factor": lambda v: float(v) == 1.0,
    "quantization_config": lambda v: not v,
    # Neither changes what an inference step computes (a split matmul, dropout in training).
    "pretraining_tp": lambda v: True,
    "attention_dropout": lambda v: True,
}

# Keys that do not change what the model computes: names, token ids, training and generation defaults.
_METADATA_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "auto_map",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "initializer_range",
        "tokenizer_class",
        "is_llama_config",
        "transformers.js_config",
        "id2label",
        "label2id",
        "problem_type",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "return_dict_in_generate",
        "is_encoder_decoder",
        "is_decoder",
        "add_cross_attention",
        "cross_attention_hidden_size",
        "tie_encoder_decoder",
        "chunk_size_feed_forward",
        "pruned_heads",
        "torchscript",
        "use_bfloat16",
        "tf_legacy_loss",
        "finetuning_task",
        "task_specific_params",
        "prefix",
        "max_length",
        "min_length",
        "do_sample",
        "early_stopping",
        "num_beams",
        "num_beam_groups",
        "diversity_penalty",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "repetition_penalty",
        "length_penalty",
        "no_repeat_ngram_size",
        "encoder_no_repeat_ngram_size",
        "bad_words_ids",
        "num_return_sequences",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "remove_invalid_values",
        "exponential_decay_length_penalty",
        "suppress_tokens",
        "begin_suppress_tokens",
        "_attn_implementation_autoset",
    }
)
