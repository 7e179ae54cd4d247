"""Convert a llama-architecture GGUF file into a Hugging Face style model folder."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from structlog.typing import FilteringBoundLogger
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from common.logs import get_logger

# Written last, inside the folder, before the folder is renamed into place; bump the
# version whenever the converter's output changes, so old folders get converted again.
CONVERTED_MARKER = "specserve_converted.json"
CONVERTER_VERSION = 1

_TOKEN_TYPE_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL: <|im_start|> and friends
_TOKEN_TYPE_USER_DEFINED = 4  # matched whole by llama.cpp, e.g. <think>

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR_NAME = re.compile(r"blk\.(?P<layer>\d+)\.(?P<part>\w+)\.weight")


def _log() -> FilteringBoundLogger:
    # Looked up per use: a logger bound at import would keep the configuration from before
    # common.logs.configure() ran.
    return get_logger(module="gguf_convert")


class GgufConversionError(ValueError):
    """The GGUF file holds something this converter cannot represent; the message says what."""


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert `gguf_path` into the new folder `out_dir`, which appears only once complete."""
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it before converting into it")
    started_s = time.monotonic()
    reader = GGUFReader(gguf_path)
    metadata = _read_metadata(reader)
    has_output = any(tensor.name == "output.weight" for tensor in reader.tensors)
    config = llama_config(metadata, tie_word_embeddings=not has_output)
    with _atomic_folder(out_dir) as staging:
        save_file(_hf_tensors(reader, config), str(staging / "model.safetensors"), metadata={"format": "pt"})
        _write_tokenizer_files(staging, metadata, config)
        _write_json(staging / "config.json", config)
        _write_json(staging / CONVERTED_MARKER, {"converter_version": CONVERTER_VERSION, "source": gguf_path.name})
    duration_s = round(time.monotonic() - started_s, 2)
    _log().info("gguf_convert.done", source=str(gguf_path), out_dir=str(out_dir), duration_s=duration_s)
    return out_dir


def is_converted(folder: Path) -> bool:
    """True when `folder` is a complete conversion by this converter version."""
    try:
        marker = json.loads((folder / CONVERTED_MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and marker.get("converter_version") == CONVERTER_VERSION


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation, from its interleaved RoPE layout to rotate_half.

    llama.cpp's converter reshapes each head's rows as [2, head_dim/2] and swaps the axes, so
    the two halves that rotate_half pairs end up interleaved; this swaps them back.
    """
    half_head_dim = weight.shape[0] // num_heads // 2
    by_head = weight.reshape(num_heads, half_head_dim, 2, *weight.shape[1:])  # [H, D/2, 2, in]
    return by_head.swapaxes(1, 2).reshape(weight.shape)  # [H*D, in]


def llama_config(metadata: dict[str, Any], *, tie_word_embeddings: bool) -> dict[str, Any]:
    """The transformers LlamaConfig dict that the GGUF metadata describes."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise GgufConversionError(f"general.architecture is {arch!r}; only 'llama' is supported")
    if metadata.get("llama.rope.scaling.type", "none") != "none":
        raise GgufConversionError(f"llama.rope.scaling.type {metadata['llama.rope.scaling.type']!r} is not supported")
    hidden_size = int(metadata["llama.embedding_length"])
    num_heads = int(metadata["llama.attention.head_count"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "intermediate_size": int(metadata["llama.feed_forward_length"]),
        "num_hidden_layers": int(metadata["llama.block_count"]),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(metadata.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": int(metadata.get("llama.rope.dimension_count", hidden_size // num_heads)),
        "rms_norm_eps": float(metadata["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(metadata.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(metadata["llama.context_length"]),
        "vocab_size": int(metadata.get("llama.vocab_size", len(metadata["tokenizer.ggml.tokens"]))),
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
        "hidden_act": "silu",
    }


def _read_metadata(reader: GGUFReader) -> dict[str, Any]:
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _hf_tensors(reader: GGUFReader, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every GGUF tensor dequantized to float32, under its Hugging Face name."""
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        name = _hf_tensor_name(tensor.name)
        weight = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if name.endswith("self_attn.q_proj.weight"):
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(weight)
    _check_complete(tensors, config)
    return tensors


def _hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match["part"] not in _LAYER_TENSORS:
        raise GgufConversionError(f"GGUF tensor {gguf_name!r} has no Llama counterpart")
    return f"model.layers.{match['layer']}.{_LAYER_TENSORS[match['part']]}.weight"


def _check_complete(tensors: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    for layer in range(config["num_hidden_layers"]):
        expected.update(f"model.layers.{layer}.{part}.weight" for part in _LAYER_TENSORS.values())
    missing = sorted(expected - tensors.keys())
    extra = sorted(tensors.keys() - expected)
    if missing or extra:
        raise GgufConversionError(f"GGUF tensors do not match the config: missing {missing[:5]}, extra {extra[:5]}")
    vocab_rows = tensors["model.embed_tokens.weight"].shape[0]
    if vocab_rows != config["vocab_size"]:
        raise GgufConversionError(f"token_embd has {vocab_rows} rows but vocab_size is {config['vocab_size']}")


def _write_tokenizer_files(folder: Path, metadata: dict[str, Any], config: dict[str, Any]) -> None:
    tokenizer = build_tokenizer(metadata)
    tokenizer.save(str(folder / "tokenizer.json"))
    special = _special_tokens(metadata)
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": metadata.get("tokenizer.chat_template"),
        **special,
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    })
    _write_json(folder / "special_tokens_map.json", {
        **{name: token for name, token in special.items() if token is not None},
        "additional_special_tokens": _tokens_of_type(metadata, _TOKEN_TYPE_CONTROL),
    })
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
                  "pad_token_id": config["pad_token_id"]}
    _write_json(folder / "generation_config.json", {k: v for k, v in generation.items() if v is not None})


def build_tokenizer(metadata: dict[str, Any]) -> Tokenizer:
    """The byte-level BPE tokenizer that the GGUF's tokenizer.ggml.* fields describe."""
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GgufConversionError(f"tokenizer.ggml.model {model!r} is not supported; only 'gpt2' (byte-level BPE)")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=_merges(metadata), fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(metadata)
    # Both kinds are matched whole and never split; only control tokens are "special"
    # (skipped when decoding with skip_special_tokens), as transformers' GGUF loader does.
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                  for token in _tokens_of_type(metadata, _TOKEN_TYPE_CONTROL)])
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token in _tokens_of_type(metadata, _TOKEN_TYPE_USER_DEFINED)])
    return tokenizer


def _merges(metadata: dict[str, Any]) -> list[tuple[str, str]]:
    merges: list[tuple[str, str]] = []
    for merge in metadata.get("tokenizer.ggml.merges", []):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right or " " in right:
            raise GgufConversionError(f"tokenizer.ggml.merges entry {merge!r} is not two tokens")
        merges.append((left, right))
    return merges


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The split a vocabulary's merges were learned on, named by tokenizer.ggml.pre."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    raise GgufConversionError(f"tokenizer.ggml.pre {pre!r} is not supported")


def _post_processor(metadata: dict[str, Any]) -> processors.PostProcessor:
    """Prepend BOS when the GGUF says so, so tokenizer.json alone encodes like llama.cpp."""
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    if not metadata.get("tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return processors.ByteLevel(trim_offsets=False)
    bos = metadata["tokenizer.ggml.tokens"][bos_id]
    return processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                         special_tokens=[(bos, bos_id)])


def _tokens_of_type(metadata: dict[str, Any], token_type: int) -> list[str]:
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type", [])
    return [token for token, kind in zip(tokens, types, strict=False) if kind == token_type]


def _special_tokens(metadata: dict[str, Any]) -> dict[str, str | None]:
    tokens = metadata["tokenizer.ggml.tokens"]
    ids = {
        "bos_token": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token": metadata.get("tokenizer.ggml.eos_token_id"),
        "unk_token": metadata.get("tokenizer.ggml.unknown_token_id"),
        "pad_token": metadata.get("tokenizer.ggml.padding_token_id"),
    }
    return {name: (tokens[token_id] if token_id is not None else None) for name, token_id in ids.items()}


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextmanager
def _atomic_folder(out_dir: Path) -> Iterator[Path]:
    """A staging folder beside `out_dir`, renamed to it on success and removed on failure."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the finished folder is an ordinary one
    try:
        yield staging
        for path in staging.iterdir():
            path.chmod(0o644)  # safetensors writes its file private
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
