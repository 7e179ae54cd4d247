"""The model configuration, read from a Hugging Face style config.json, for the families this code runs.

Every family is a decoder of the Llama shape (RMSNorm, RoPE, grouped-query attention, a
gated MLP); what differs is a handful of switches read here: biases (Qwen2, and Llama or
Qwen3 with `attention_bias`), RMS norms on each head's queries and keys (Qwen3, Gemma 3),
sliding-window attention on some or all layers (Mistral, Qwen with `use_sliding_window`,
Gemma 3's local layers, which also have their own RoPE base), scaled RoPE (modeling/model/rope.py),
and Gemma 3's norms (weights stored as w - 1, four per layer), embedding scale, query scale
and GELU-tanh MLP. Every key of config.json is read: what changes the math is implemented or
refused (UnsupportedModel, naming the key), and a key this code does not know (the keys it
knows, per family, are in modeling/model/families.py) is refused too, since it may change it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modeling.model.families import ACTIVATIONS, FAMILIES, NEUTRAL_KEYS, Family
from modeling.model.rope import Rope, RopeError


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
    rope_theta: float  # the RoPE base of the full-attention layers
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q, k and v projections have biases
    model_type: str = "llama"
    o_bias: bool = False  # the output projection has a bias
    mlp_bias: bool = False
    hidden_act: str = "silu"  # or gelu_pytorch_tanh: the gate's activation
    qk_norm: bool = False  # an RMSNorm over head_dim on every query and key head, before RoPE
    rope_scaling: Rope | None = None  # the full-attention layers' RoPE when not plain
    # Per layer: attends only to the last sliding_window positions (itself included).
    sliding_layers: tuple[bool, ...] = ()
    sliding_window: int | None = None
    local_rope_theta: float | None = None  # the sliding layers' own (plain) RoPE base, where they have one
    # Gemma's conventions: norm weights applied as (1 + w), sandwich norms around attention
    # and MLP, embeddings scaled by sqrt(hidden_size), scores by query_pre_attn_scalar^-0.5.
    gemma: bool = False
    query_pre_attn_scalar: float | None = None

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def global_rope(self) -> Rope:
        return self.rope_scaling or Rope(self.rope_theta, max_position_embeddings=self.max_position_embeddings)

    def layer_rope(self, layer: int) -> Rope:
        if self.local_rope_theta is not None and self.is_sliding(layer):
            return Rope(self.local_rope_theta, max_position_embeddings=self.max_position_embeddings)
        return self.global_rope

    def is_sliding(self, layer: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[layer]

    def layer_window(self, layer: int) -> int | None:
        """How many positions (itself included) layer `layer` attends to at most; None: all."""
        return self.sliding_window if self.is_sliding(layer) else None

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Reads every key of a Hugging Face config.json (UnsupportedModel, naming the key, for what it cannot run)."""
        model_type = hf.get("model_type", "")
        if model_type == "gemma3":
            raise UnsupportedModel(
                "config.json model_type 'gemma3' is Gemma 3 with its vision tower; only the text "
                "model (model_type 'gemma3_text') is supported"
            )
        if model_type not in FAMILIES:
            raise UnsupportedModel(f"config.json model_type {model_type!r} is not one of {sorted(FAMILIES)}")
        family = FAMILIES[model_type]
        unknown = sorted(set(hf) - family.known_keys())
        if unknown:
            raise UnsupportedModel(
                f"config.json key {unknown[0]!r} is not known to this server for model_type "
                f"{model_type!r} and may change the model's math; refusing rather than serving it "
                f"wrongly (unknown keys: {unknown})"
            )
        for key, neutral in NEUTRAL_KEYS.items():
            if key in hf and not neutral(hf[key]):
                raise UnsupportedModel(f"config.json {key} {hf[key]!r} is not supported")
        activation = hf.get(family.activation_key) or family.default_activation
        if activation not in ACTIVATIONS or (activation != "silu") != family.gemma:
            raise UnsupportedModel(
                f"config.json {family.activation_key} {activation!r} is not supported for "
                f"{model_type} (expected {family.default_activation!r})"
            )
        num_heads = int(hf["num_attention_heads"])
        num_kv_heads = int(hf.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedModel(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        hidden_size = int(hf["hidden_size"])
        num_layers = int(hf["num_hidden_layers"])
        max_positions = int(hf.get("max_position_embeddings") or family.default_max_positions)
        attention_bias = bool(hf.get("attention_bias", False))
        if family.gemma:
            _check_gemma(hf)
        rope, local_theta = _ropes(hf, family, max_positions)
        sliding_layers, window = _windows(hf, model_type, num_layers)
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(hf.get("head_dim") or family.default_head_dim or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.default_tied)),
            attention_bias=family.qkv_bias or attention_bias,
            model_type=model_type,
            o_bias=attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            hidden_act=activation,
            qk_norm=family.qk_norm,
            rope_scaling=None if rope.kind == "default" else rope,
            sliding_layers=sliding_layers,
            sliding_window=window,
            local_rope_theta=local_theta,
            gemma=family.gemma,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)) if family.gemma else None,
        )

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = folder / "config.json"
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise UnsupportedModel(f"{path} does not exist: not a Hugging Face model folder") from exc
        except json.JSONDecodeError as exc:
            raise UnsupportedModel(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_hf(hf)


_GEMMA_LOCAL_THETA = 10000.0


def _check_gemma(hf: dict[str, Any]) -> None:
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if hf.get(key) is not None:
            raise UnsupportedModel(f"config.json {key} {hf[key]!r} is not supported (Gemma 3 has none)")
    if hf.get("use_bidirectional_attention"):
        raise UnsupportedModel("config.json use_bidirectional_attention true is not supported (a causal decoder only)")


def _ropes(hf: dict[str, Any], family: Family, max_positions: int) -> tuple[Rope, float | None]:
    """The full-attention layers' RoPE and, for Gemma 3, the sliding layers' own base, from either spelling."""
    parameters = hf.get("rope_parameters")
    if family.gemma:
        local_theta = float(hf.get("rope_local_base_freq", _GEMMA_LOCAL_THETA))
        if isinstance(parameters, dict) and ("full_attention" in parameters or "sliding_attention" in parameters):
            others = sorted(set(parameters) - {"full_attention", "sliding_attention"})
            if others:
                raise UnsupportedModel(f"config.json rope_parameters has {others[0]!r}, not a layer type")
            local = parameters.get("sliding_attention") or {}
            local_rope = _rope(
                "rope_parameters.sliding_attention", local, None, {"rope_theta": local_theta}, family, max_positions
            )
            if local_rope.kind != "default":
                raise UnsupportedModel(
                    f"config.json rope_parameters.sliding_attention.rope_type {local_rope.kind!r} is "
                    "not supported (Gemma 3's local layers use plain RoPE)"
                )
            if "rope_local_base_freq" in hf and local_rope.theta != local_theta:
                raise UnsupportedModel(
                    "config.json rope_local_base_freq and rope_parameters.sliding_attention.rope_theta disagree"
                )
            global_rope = _rope(
                "rope_parameters.full_attention",
                parameters.get("full_attention") or {},
                hf.get("rope_scaling"),
                hf,
                family,
                max_positions,
            )
            return global_rope, local_rope.theta
        return _rope("rope_parameters", parameters, hf.get("rope_scaling"), hf, family, max_positions), local_theta
    return _rope("rope_parameters", parameters, hf.get("rope_scaling"), hf, family, max_positions), None


def _rope(where: str, parameters: Any, scaling: Any, hf: dict[str, Any], family: Family, max_positions: int) -> Rope:
    """One RoPE from `parameters` (transformers 5) or `scaling` (older, beside the top-level rope_theta)."""
    found = []
    for key, value in ((where, parameters), ("rope_scaling", scaling)):
        if value is None:
            continue
        if not isinstance(value, dict):
            raise UnsupportedModel(f"config.json {key} {value!r} is not an object")
        found.append((key, value))
    thetas = {
        float(v)
        for v in ((parameters or {}).get("rope_theta"), (scaling or {}).get("rope_theta"), hf.get("rope_theta"))
        if v is not None
    }
    if len(thetas) > 1:
        raise UnsupportedModel(
            f"config.json gives several RoPE bases ({sorted(thetas)}): rope_theta and {where}.rope_theta disagree"
        )
    theta = thetas.pop() if thetas else family.default_theta
    ropes = []
    for key, value in found:
        try:
            ropes.append(Rope.from_hf(key, value, theta, max_positions))
        except RopeError as exc:
            raise UnsupportedModel(str(exc)) from exc
    if len({rope for rope in ropes}) > 1:
        raise UnsupportedModel(f"config.json {where} and rope_scaling describe different RoPE scalings")
    return ropes[0] if ropes else Rope(theta, max_position_embeddings=max_positions)


def _windows(hf: dict[str, Any], model_type: str, num_layers: int) -> tuple[tuple[bool, ...], int | None]:
    """Which layers attend through a sliding window, and its width, as transformers decides it per family."""
    layer_types = hf.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != num_layers or set(layer_types) - {"full_attention", "sliding_attention"}:
            raise UnsupportedModel(
                f"config.json layer_types {layer_types!r} is not one of full_attention or "
                f"sliding_attention per layer ({num_layers} layers)"
            )
    if model_type == "llama":
        return (), None
    if model_type == "mistral":
        window = hf.get("sliding_window", 4096)
        return ((True,) * num_layers, int(window)) if window is not None else ((), None)
    if model_type in ("qwen2", "qwen3"):
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        if window is None:
            return (), None
        if layer_types is None:
            first = int(hf.get("max_window_layers", 28))
            return tuple(layer >= first for layer in range(num_layers)), int(window)
        return tuple(kind == "sliding_attention" for kind in layer_types), int(window)
    # Gemma 3: every sliding_window_pattern-th layer is global, the others local.
    window = hf.get("sliding_window", 4096)
    if layer_types is None:
        pattern = int(hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6)))
        layer_types = [
            "sliding_attention" if (layer + 1) % pattern else "full_attention" for layer in range(num_layers)
        ]
    return tuple(kind == "sliding_attention" for kind in layer_types), None if window is None else int(window)


def model_fingerprint(folder: Path) -> str:
    """A short hash that tells two models apart without reading all of their weights.

    Covers what the model computes, not how its files spell it: the configuration as read
    (so config.json in either RoPE spelling, in any key order, gives one fingerprint), and
    every tensor's name, dtype, shape and its first, middle and last few KiB (so a
    fine-tune that changed only some layers, a merged LoRA on the attention say, is another
    model), wherever the tensor lies: one file or shards.
    """
    from modeling.model.weights import WeightFiles

    digest = hashlib.sha256(repr(ModelConfig.from_folder(folder)).encode())
    files = WeightFiles(folder)
    for name in sorted(files.names()):
        digest.update(f"{name}:{files.dtype(name)}:{files.shape(name)}".encode())
        for sample in files.samples(name, _TENSOR_SAMPLE_BYTES):
            digest.update(sample)
    return digest.hexdigest()[:16]


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
