"""The Llama-family model configuration, read from a Hugging Face style config.json."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})


class UnsupportedModel(ValueError):
    """The folder holds a model this code cannot run; the message says which field."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads every key of a Hugging Face config.json: what changes the model's math is implemented or refused
        (UnsupportedModel, naming the key); a key this code does not know is refused too, since it may change it."""
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"config.json model_type {model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}")
        unknown = sorted(set(hf) - _MATH_KEYS - set(_NEUTRAL_KEYS) - _METADATA_KEYS)
        if unknown:
            raise UnsupportedModel(f"config.json key {unknown[0]!r} is not known to this server and may change the "
                                   f"model's math; refusing rather than serving it wrongly (unknown keys: {unknown})")
        for key, neutral in _NEUTRAL_KEYS.items():
            if key in hf and not neutral(hf[key], hf):
                raise UnsupportedModel(f"config.json {key} {hf[key]!r} is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"config.json hidden_act {hf['hidden_act']!r} is not 'silu'")
        num_heads = int(hf["num_attention_heads"])
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModel(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        hidden_size = int(hf["hidden_size"])
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = folder / "config.json"
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise UnsupportedModel(f"{path} does not exist: not a Hugging Face model folder") from exc
        return cls.from_hf(hf)


def rope_theta(hf: dict[str, Any]) -> float:
    """The RoPE base, from either spelling: transformers 5's `rope_parameters` or the older top-level `rope_theta`
    with `rope_scaling`. Only plain RoPE is implemented; any other type is refused, naming it."""
    parameters = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    for key, value in (("rope_parameters", parameters), ("rope_scaling", scaling)):
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UnsupportedModel(f"config.json {key} {value!r} is not an object")
        rope_type = value.get("rope_type", value.get("type", "default"))
        if rope_type != "default":
            raise UnsupportedModel(f"config.json {key}.rope_type {rope_type!r} is not supported (supported: 'default', "
                                   "plain RoPE)")
        others = sorted(set(value) - {"rope_type", "type", "rope_theta"})
        if others:
            raise UnsupportedModel(f"config.json {key} has {others[0]!r}, which plain RoPE does not take")
    thetas = {float(v) for v in ((parameters or {}).get("rope_theta"), (scaling or {}).get("rope_theta"), hf.get("rope_theta"))
              if v is not None}
    if len(thetas) > 1:
        raise UnsupportedModel(f"config.json gives several RoPE bases ({sorted(thetas)}): rope_theta and "
                               "rope_parameters.rope_theta disagree")
    return thetas.pop() if thetas else 10000.0


# Keys that change the math and that from_hf reads (rope_* in rope_theta()).
_MATH_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "hidden_act",
})


def _no_window(value: Any, hf: dict[str, Any]) -> bool:
    """A sliding window changes attention only where it is used and shorter than the model's context."""
    if value is None or hf.get("use_sliding_window") is False:
        return True
    return int(value) >= int(hf.get("max_position_embeddings", 2048))


# Keys that would change the math, accepted only at the value that leaves it as implemented.
_NEUTRAL_KEYS: dict[str, Any] = {
    "mlp_bias": lambda v, hf: not v,
    "sliding_window": _no_window,
    "use_sliding_window": lambda v, hf: not v or _no_window(hf.get("sliding_window"), hf),
    "max_window_layers": lambda v, hf: not hf.get("use_sliding_window"),
    "layer_types": lambda v, hf: all(t == "full_attention" for t in v) or _no_window(hf.get("sliding_window"), hf),
    "rope_interleaved": lambda v, hf: not v,
    "partial_rotary_factor": lambda v, hf: float(v) == 1.0,
    "attn_logit_softcapping": lambda v, hf: v is None,
    "final_logit_softcapping": lambda v, hf: v is None,
    "quantization_config": lambda v, hf: not v,
    # Neither changes what an inference step computes (a split matmul, dropout in training).
    "pretraining_tp": lambda v, hf: True,
    "attention_dropout": lambda v, hf: True,
}

# Keys that do not change what the model computes: names, token ids, training and generation defaults.
_METADATA_KEYS = frozenset({
    "_name_or_path", "architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id", "initializer_range",
    "tokenizer_class", "is_llama_config", "transformers.js_config", "id2label", "label2id", "problem_type",
    "return_dict", "output_attentions", "output_hidden_states", "output_scores", "return_dict_in_generate",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "cross_attention_hidden_size", "tie_encoder_decoder",
    "chunk_size_feed_forward", "pruned_heads", "torchscript", "use_bfloat16", "tf_legacy_loss", "finetuning_task",
    "task_specific_params", "prefix", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
    "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "_attn_implementation_autoset",
})


def model_fingerprint(folder: Path) -> str:
    """A short hash that tells two model folders apart without reading all of their weights.

    Covers config.json, every safetensors header (names, dtypes, shapes, offsets), the
    first and last few KiB of every tensor (so a fine-tune that changed only some
    layers, a merged LoRA on the attention say, is another model) and a few sampled
    64 KiB pieces of each weight file.
    """
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        size = path.stat().st_size
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = f.read(header_len)
            digest.update(header)
            spans = sorted(tuple(entry["data_offsets"]) for name, entry in json.loads(header).items() if name != "__metadata__")
            for start, end in spans:
                for offset in sorted({start, max(start, end - _TENSOR_SAMPLE_BYTES)}):
                    f.seek(8 + header_len + offset)
                    digest.update(f.read(min(_TENSOR_SAMPLE_BYTES, end - offset)))
            for fraction in (0.1, 0.5, 0.9):
                f.seek(int(size * fraction))
                digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


_SAMPLE_BYTES = 64 * 1024
_TENSOR_SAMPLE_BYTES = 4 * 1024


def vocab_fingerprint(folder: Path) -> str:
    """A short hash of the tokenizer's vocabulary (token strings and ids, added tokens too).

    Two models whose fingerprints match give the same id the same meaning, which a draft
    model needs in order to propose tokens for a target. Without a tokenizer.json the
    vocabulary size stands in.
    """
    path = folder / "tokenizer.json"
    if not path.exists():
        return f"vocab-size-{ModelConfig.from_folder(folder).vocab_size}"
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer.get("model", {}).get("vocab", {})
    added = {token["content"]: token["id"] for token in tokenizer.get("added_tokens", [])}
    canonical = json.dumps({"vocab": vocab, "added": added}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
