"""Convert a GGUF file (llama, qwen2, qwen3 or gemma3) into a Hugging Face style model folder.

The folder holds config.json (modeling/gguf/arch.py), model.safetensors with every tensor
dequantized to float32 under its transformers name, the tokenizer files
(modeling/gguf/tokenizer.py), and the GGUF file itself (`model.gguf`), whose quantized
blocks the CPU kernels can serve as they are (modeling/kernels/blocks.py).
What the converter cannot represent (an architecture, a
tensor, a metadata key, a quantization type) is refused with GgufConversionError naming it,
never dropped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from structlog.typing import FilteringBoundLogger
from tokenizers import Tokenizer

from common.logs import get_logger
from modeling.gguf.arch import GLOBAL_TENSORS, ROPE_FREQS_TENSOR, Architecture, architecture, hf_config
from modeling.gguf.metadata import GgufConversionError, GgufMetadata
from modeling.gguf.tokenizer import build_tokenizer, generation_config, special_tokens_map, tokenizer_config

__all__ = [
    "CONVERTED_MARKER",
    "CONVERTER_VERSION",
    "GGUF_FILE",
    "GgufConversionError",
    "convert_gguf",
    "hf_tensor_name",
    "is_converted",
    "read_gguf",
    "unpermute_rope_rows",
]

# Written last, inside the folder, before the folder is renamed into place; bump the
# version whenever the converter's output changes, so old folders get converted again.
CONVERTED_MARKER = "specserve_converted.json"
CONVERTER_VERSION = 3
GGUF_FILE = "model.gguf"  # the source file, kept beside its conversion

_LAYER_TENSOR_NAME = re.compile(r"blk\.(?P<layer>\d+)\.(?P<part>.+)")


def _log() -> FilteringBoundLogger:
    # Looked up per use: a logger bound at import would keep the configuration from before
    # common.logs.configure() ran.
    return get_logger(module="gguf_convert")


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert `gguf_path` into the new folder `out_dir`, which appears only once complete.

    Raises GgufConversionError, naming the file and what in it is not supported or not readable.
    """
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it before converting into it")
    started_s = time.monotonic()
    try:
        reader, metadata = read_gguf(gguf_path)
        plan = _plan(reader, metadata)
        with _atomic_folder(out_dir) as staging:
            tensors = _hf_tensors(reader, plan.layout, plan.config)
            save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
            plan.tokenizer.save(str(staging / "tokenizer.json"))
            _keep_source(gguf_path, staging / GGUF_FILE)
            for name, value in plan.json_files.items():
                _write_json(staging / name, value)
            _write_json(staging / CONVERTED_MARKER, {"converter_version": CONVERTER_VERSION, "source": gguf_path.name})
    except GgufConversionError as exc:
        raise GgufConversionError(f"{gguf_path}: {exc}") from exc
    duration_s = round(time.monotonic() - started_s, 2)
    _log().info("gguf_convert.done", source=str(gguf_path), out_dir=str(out_dir), duration_s=duration_s)
    return out_dir


@dataclass(frozen=True)
class _Plan:
    """What the metadata says the folder holds, decided before anything is written."""

    layout: Architecture
    config: dict[str, Any]  # config.json
    tokenizer: Tokenizer
    json_files: dict[str, dict[str, Any]]  # file name -> content, config.json among them


def _plan(reader: GGUFReader, metadata: GgufMetadata) -> _Plan:
    try:
        layout = architecture(metadata)
        config = hf_config(metadata, {tensor.name for tensor in reader.tensors}, _rope_freqs(reader))
        json_files = {
            "config.json": config,
            "tokenizer_config.json": tokenizer_config(metadata, config),
            "special_tokens_map.json": special_tokens_map(metadata),
            "generation_config.json": generation_config(metadata, config),
        }
        tokenizer = build_tokenizer(metadata)
    except GgufConversionError:
        raise
    except (KeyError, IndexError, TypeError, ValueError) as exc:  # a value of the wrong type or out of range
        raise GgufConversionError(f"malformed metadata ({type(exc).__name__}: {exc})") from exc
    metadata.refuse_unread()
    return _Plan(layout, config, tokenizer, json_files)


def read_gguf(gguf_path: Path) -> tuple[GGUFReader, GgufMetadata]:
    """The file's tensors and metadata; GgufConversionError when it is not a readable GGUF file."""
    try:
        reader = GGUFReader(gguf_path)
    except (ValueError, IndexError, KeyError, TypeError) as exc:  # gguf's reader raises these on a damaged file
        reason = f"{type(exc).__name__}: {exc}"
        raise GgufConversionError(f"not a readable GGUF file: truncated or damaged ({reason})") from exc
    values = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    return reader, GgufMetadata(values)


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


def _rope_freqs(reader: GGUFReader) -> np.ndarray | None:
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:
            return _dequantized(tensor)
    return None


def _dequantized(tensor: ReaderTensor) -> np.ndarray:
    try:
        weight = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise GgufConversionError(
            f"GGUF tensor {tensor.name!r} is of type {tensor.tensor_type.name}, which cannot be dequantized"
        ) from exc
    return weight.astype(np.float32, copy=False)


def _hf_tensors(reader: GGUFReader, layout: Architecture, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every GGUF tensor dequantized to float32, under its transformers name, in transformers' layout."""
    tensors: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        if tensor.name == ROPE_FREQS_TENSOR:  # part of the config (rope_parameters), not a weight
            continue
        name = hf_tensor_name(tensor.name, layout, config["model_type"])
        weight = _dequantized(tensor)
        if layout.rope_rows_permuted and name.endswith("self_attn.q_proj.weight"):
            weight = unpermute_rope_rows(weight, config["num_attention_heads"])
        elif layout.rope_rows_permuted and name.endswith("self_attn.k_proj.weight"):
            weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
        if layout.norms_plus_one and "norm.weight" in tensor.name:
            weight = weight - np.float32(1.0)
        tensors[name] = np.ascontiguousarray(weight)
    _check_complete(tensors, layout, config)
    return tensors


def hf_tensor_name(gguf_name: str, layout: Architecture, model_type: str) -> str:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = _LAYER_TENSOR_NAME.fullmatch(gguf_name)
    if match is None or match["part"] not in layout.layer_tensors:
        raise GgufConversionError(f"GGUF tensor {gguf_name!r} has no counterpart in a {model_type} model")
    return f"model.layers.{match['layer']}.{layout.layer_tensors[match['part']]}"


def _check_complete(tensors: dict[str, np.ndarray], layout: Architecture, config: dict[str, Any]) -> None:
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config["tie_word_embeddings"]:
        expected.add("lm_head.weight")
    for layer in range(config["num_hidden_layers"]):
        expected.update(f"model.layers.{layer}.{part}" for part in layout.layer_tensors.values())
    missing = sorted(expected - tensors.keys())
    extra = sorted(tensors.keys() - expected)
    if missing or extra:
        raise GgufConversionError(f"GGUF tensors do not match the config: missing {missing[:5]}, extra {extra[:5]}")
    vocab_rows = tensors["model.embed_tokens.weight"].shape[0]
    if vocab_rows != config["vocab_size"]:
        raise GgufConversionError(f"token_embd has {vocab_rows} rows but vocab_size is {config['vocab_size']}")


def _keep_source(gguf_path: Path, target: Path) -> None:
    """A link to the source file where the file system allows one (the fetched file, in the same cache), else a copy."""
    try:
        os.link(gguf_path, target)
    except OSError:
        shutil.copyfile(gguf_path, target)


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
            if path.name != GGUF_FILE:  # the source may be a link to a user's own file: its mode is theirs
                path.chmod(0o644)  # safetensors writes its file private
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
