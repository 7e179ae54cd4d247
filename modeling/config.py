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
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModel(f"config.json model_type {model_type!r} is not one of {sorted(SUPPORTED_MODEL_TYPES)}")
        if hf.get("rope_scaling"):
            raise UnsupportedModel(f"config.json rope_scaling {hf['rope_scaling']!r} is not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"config.json hidden_act {hf['hidden_act']!r} is not 'silu'")
        num_heads = int(hf["num_attention_heads"])
        num_kv_heads = int(hf.get("num_key_value_heads", num_heads))
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
            rope_theta=float(hf.get("rope_theta", 10000.0)),
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
