"""Tiny GGUF files written with gguf's own writer, in the layout llama.cpp writes for each architecture.

Random weights, some float and some quantized (F16, BF16, Q8_0, Q4_0, Q5_0, Q4_K), and small
vocabularies of both kinds: byte-level BPE (GPT-2's byte alphabet plus a few merges) and
SentencePiece BPE (Llama 2's shape, or Gemma's with runs of spaces as user-defined tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

# Texts a converted tokenizer must encode and decode as transformers' GGUF tokenizer does.
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "x = 12345\nfor i in range(10):\n    print(i ** 2)  # 3.14159 and 2024-11-30",
    "naïve café 你好 🙂",
    "<|im_start|>user\nhi<|im_end|>\n<think>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "  leading spaces,\ttabs,\n\n\nand   runs of   spaces ",
    "a  b   c    d     e      f",
    "I'm sure they'll say it's 1000000 or 7.5%",
    "trailing newline\n",
]

CONTROL, USER_DEFINED, NORMAL, UNKNOWN, BYTE = 3, 4, 1, 2, 6


def byte_alphabet() -> list[str]:
    """GPT-2's spelling of the 256 bytes: printable Latin-1 stays itself, the rest moves to U+0100 on."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    spelled, shifted = [], 0
    for byte in range(256):
        if byte in printable:
            spelled.append(chr(byte))
        else:
            spelled.append(chr(256 + shifted))
            shifted += 1
    return spelled


BPE_MERGES = [
    "Ġ t",
    "h e",
    "Ġt he",
    "i n",
    "n g",
    "i ng",
    "Ġ a",
    "e r",
    "o n",
    "Ġ s",
    "r e",
    "a t",
    "e n",
    "Ġ w",
    "o r",
    "i c",
    "Ġ q",
    "u ic",
    "Ġq uic",
    "Ġquic k",
    "Ġ f",
    "o x",
    "Ġf ox",
    "1 2",
    "12 3",
    "Ġ Ġ",
    "ĠĠ ĠĠ",
    "Ċ Ċ",
    "' s",
    "' ll",
    "l l",
    "Ġ 1",
    "0 0",
    "00 0",
]


@dataclass
class Vocabulary:
    """The tokenizer.ggml.* fields of a tiny vocabulary."""

    model: str
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    fields: dict[str, Any] = field(default_factory=dict)  # ids, flags, pre

    def write(self, writer: GGUFWriter) -> None:
        writer.add_tokenizer_model(self.model)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.token_types)
        if self.scores is not None:
            writer.add_token_scores(self.scores)
        if self.merges is not None:
            writer.add_token_merges(self.merges)
        for key, value in self.fields.items():
            if isinstance(value, bool):
                writer.add_bool(f"tokenizer.ggml.{key}", value)
            elif isinstance(value, int):
                writer.add_uint32(f"tokenizer.ggml.{key}", value)
            else:
                writer.add_string(f"tokenizer.ggml.{key}", value)


def byte_level_vocabulary(pre: str, *, add_bos: bool) -> Vocabulary:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>"]
    merged = ["".join(merge.split(" ")) for merge in BPE_MERGES]
    tokens = specials + byte_alphabet() + merged
    types = [CONTROL, CONTROL, CONTROL, USER_DEFINED] + [NORMAL] * (len(tokens) - 4)
    return Vocabulary(
        "gpt2",
        tokens,
        types,
        merges=BPE_MERGES,
        fields={"pre": pre, "bos_token_id": 1, "eos_token_id": 2, "padding_token_id": 0, "add_bos_token": add_bos},
    )


SPM_PIECES = [
    "▁t",
    "he",
    "▁the",
    "in",
    "er",
    "▁a",
    "on",
    "re",
    "▁s",
    "at",
    "en",
    "▁w",
    "or",
    "ic",
    "▁q",
    "uic",
    "▁quic",
    "▁quick",
    "▁f",
    "ox",
    "▁fox",
    "ng",
    "ing",
    "▁l",
    "az",
    "▁laz",
    "▁lazy",
    "▁o",
    "ve",
    "▁ove",
    "▁over",
    "▁b",
    "ro",
    "wn",
    "▁bro",
    "▁brown",
    "um",
    "ps",
    "▁j",
    "▁jum",
    "▁jumps",
    "us",
    "▁us",
    "▁user",
    "hi",
    "▁hi",
    "12",
    "123",
    "ad",
    "▁sp",
    "ac",
    "es",
    "▁spac",
    "▁spaces",
    "ea",
    "▁le",
    "▁lea",
    "di",
    "▁lead",
    "ab",
    "▁tab",
    "▁tabs",
    "un",
    "▁r",
    "▁run",
    "▁runs",
    "of",
    "▁of",
    "an",
    "▁an",
    "▁and",
]
SPM_CHARS = list("▁abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?'\"()[]{}#*=+-_/%<>|\\")


def sentencepiece_vocabulary(*, gemma: bool) -> Vocabulary:
    """Gemma's shape (runs of spaces and newlines user-defined, no space prefix) or Llama 2's (a space prefix)."""
    if gemma:
        specials = [
            ("<pad>", CONTROL),
            ("<eos>", CONTROL),
            ("<bos>", CONTROL),
            ("<unk>", CONTROL),
            ("<start_of_turn>", CONTROL),
            ("<end_of_turn>", CONTROL),
            ("\n", USER_DEFINED),
            ("\n\n", USER_DEFINED),
            *((" " * width, USER_DEFINED) for width in range(2, 9)),
            ("\t", USER_DEFINED),
        ]
        fields = {
            "bos_token_id": 2,
            "eos_token_id": 1,
            "unknown_token_id": 3,
            "padding_token_id": 0,
            "add_bos_token": True,
            "add_eos_token": False,
            "add_space_prefix": False,
        }
    else:
        specials = [("<unk>", UNKNOWN), ("<s>", CONTROL), ("</s>", CONTROL)]
        fields = {
            "bos_token_id": 1,
            "eos_token_id": 2,
            "unknown_token_id": 0,
            "add_bos_token": True,
            "add_space_prefix": True,
        }
    pieces = list(dict.fromkeys(SPM_PIECES))
    tokens = (
        [token for token, _ in specials]
        + [f"<0x{byte:02X}>" for byte in range(256)]
        + pieces
        + [char for char in SPM_CHARS if char not in pieces]
    )
    types = [kind for _, kind in specials] + [BYTE] * 256 + [NORMAL] * (len(tokens) - len(specials) - 256)
    num_pieces = len(tokens) - len(specials) - 256
    scores = [-1000.0] * len(specials) + [0.0] * 256 + [-float(rank) for rank in range(num_pieces)]
    return Vocabulary("llama", tokens, types, scores=scores, fields={"pre": "default", **fields})


@dataclass
class Shape:
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    num_layers: int = 2
    intermediate_size: int = 256


def q4_k_blocks(rng: np.random.Generator, rows: int, columns: int) -> np.ndarray:
    """Random Q4_K blocks (gguf-py has no Q4_K quantizer): sane f16 scales, random nibbles and sub-block scales."""
    blocks = rng.integers(0, 256, size=(rows, columns // 256, 144), dtype=np.uint8)
    scales = np.stack(
        [np.full((rows, columns // 256), 0.002, np.float16), np.full((rows, columns // 256), 0.001, np.float16)],
        axis=-1,
    )  # d, dmin
    blocks[..., :4] = scales.view(np.uint8).reshape(rows, columns // 256, 4)
    return blocks.reshape(rows, -1)


_VALUE_TYPES = {int: GGUFValueType.UINT32, float: GGUFValueType.FLOAT32, str: GGUFValueType.STRING}
_DENSE: dict[GGMLQuantizationType, type[np.floating[Any]]] = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
}


class TinyGguf:
    """A GGUF file of random weights in the layout llama.cpp writes for `arch`."""

    def __init__(self, arch: str, shape: Shape, vocabulary: Vocabulary, *, seed: int = 0) -> None:
        self.arch, self.shape, self.vocabulary = arch, shape, vocabulary
        self.rng = np.random.default_rng(seed)
        self.metadata: dict[str, Any] = {}  # extra {arch}.* keys: int (uint32), float (float32) or str
        self.tensors: list[tuple[str, np.ndarray, GGMLQuantizationType]] = []
        self._model()

    def _weight(self, rows: int, columns: int, scale: float = 0.08) -> np.ndarray:
        return (self.rng.standard_normal((rows, columns)) * scale).astype(np.float32)

    def add(self, name: str, weight: np.ndarray, kind: GGMLQuantizationType = GGMLQuantizationType.F32) -> None:
        self.tensors.append((name, weight, kind))

    def _model(self) -> None:
        shape, gemma = self.shape, self.arch == "gemma3"
        q_rows, kv_rows = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        vocab_size = len(self.vocabulary.tokens)
        self.add("token_embd.weight", self._weight(vocab_size, shape.hidden_size), GGMLQuantizationType.F16)
        self.add("output_norm.weight", self._norm(shape.hidden_size))
        if not gemma:
            self.add("output.weight", self._weight(vocab_size, shape.hidden_size), GGMLQuantizationType.Q8_0)
        for layer in range(shape.num_layers):
            blk = f"blk.{layer}."
            self.add(blk + "attn_norm.weight", self._norm(shape.hidden_size))
            self.add(blk + "attn_q.weight", self._weight(q_rows, shape.hidden_size), GGMLQuantizationType.Q8_0)
            self.add(blk + "attn_k.weight", self._weight(kv_rows, shape.hidden_size), GGMLQuantizationType.Q4_0)
            self.add(blk + "attn_v.weight", self._weight(kv_rows, shape.hidden_size), GGMLQuantizationType.Q5_0)
            self.add(blk + "attn_output.weight", self._weight(shape.hidden_size, q_rows), GGMLQuantizationType.BF16)
            self.add(
                blk + "ffn_gate.weight",
                self._weight(shape.intermediate_size, shape.hidden_size),
                GGMLQuantizationType.Q8_0,
            )
            self.add(blk + "ffn_up.weight", self._weight(shape.intermediate_size, shape.hidden_size))
            self.add(
                blk + "ffn_down.weight",
                q4_k_blocks(self.rng, shape.hidden_size, shape.intermediate_size),
                GGMLQuantizationType.Q4_K,
            )
            self.add(blk + "ffn_norm.weight", self._norm(shape.hidden_size))
            if self.arch == "qwen2":
                for part, rows in (("attn_q", q_rows), ("attn_k", kv_rows), ("attn_v", kv_rows)):
                    self.add(f"{blk}{part}.bias", (self.rng.standard_normal(rows) * 0.1).astype(np.float32))
            if self.arch in ("qwen3", "gemma3"):
                self.add(blk + "attn_q_norm.weight", self._norm(shape.head_dim))
                self.add(blk + "attn_k_norm.weight", self._norm(shape.head_dim))
            if gemma:
                self.add(blk + "post_attention_norm.weight", self._norm(shape.hidden_size))
                self.add(blk + "post_ffw_norm.weight", self._norm(shape.hidden_size))

    def _norm(self, width: int) -> np.ndarray:
        # Gemma's are stored as w + 1, the others as w: around 1 either way.
        return (1.0 + self.rng.standard_normal(width) * 0.1).astype(np.float32)

    def hyperparameters(self, writer: GGUFWriter) -> None:
        shape = self.shape
        writer.add_context_length(4096)
        writer.add_embedding_length(shape.hidden_size)
        writer.add_block_count(shape.num_layers)
        writer.add_feed_forward_length(shape.intermediate_size)
        writer.add_head_count(shape.num_heads)
        writer.add_head_count_kv(shape.num_kv_heads)
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_rope_freq_base(500000.0 if self.arch == "llama" else 1000000.0)
        if self.arch == "llama":
            writer.add_rope_dimension_count(shape.head_dim)
            writer.add_vocab_size(len(self.vocabulary.tokens))
        if self.arch in ("qwen3", "gemma3"):
            writer.add_key_length(shape.head_dim)
            writer.add_value_length(shape.head_dim)
        if self.arch == "gemma3":
            writer.add_sliding_window(512)
        writer.add_file_type(1)

    def write(self, path: Path) -> Path:
        writer = GGUFWriter(str(path), self.arch)
        writer.add_name(f"tiny {self.arch}")
        self.hyperparameters(writer)
        for key, value in self.metadata.items():
            writer.add_key_value(key, value, _VALUE_TYPES[type(value)])
        self.vocabulary.write(writer)
        for name, weight, tensor_type in self.tensors:
            if tensor_type in _DENSE:
                writer.add_tensor(name, weight.astype(_DENSE[tensor_type]))
            elif tensor_type == GGMLQuantizationType.Q4_K:
                writer.add_tensor(name, weight, raw_dtype=tensor_type)
            else:
                writer.add_tensor(name, quantize(weight, tensor_type), raw_dtype=tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path


FAMILIES = {
    "llama": lambda: TinyGguf("llama", Shape(), byte_level_vocabulary("llama-bpe", add_bos=True)),
    "llama-spm": lambda: TinyGguf("llama", Shape(), sentencepiece_vocabulary(gemma=False)),
    "qwen2": lambda: TinyGguf("qwen2", Shape(), byte_level_vocabulary("qwen2", add_bos=False)),
    # transformers' GGUF loader reads no head width for qwen3 (its config's default, 128, applies), nor a query
    # scale for gemma3 (256), so these files use those widths, for transformers to load them right.
    "qwen3": lambda: TinyGguf("qwen3", Shape(head_dim=128), byte_level_vocabulary("qwen2", add_bos=False)),
    "gemma3": lambda: TinyGguf(
        "gemma3", Shape(num_heads=2, num_kv_heads=1, head_dim=256, num_layers=6), sentencepiece_vocabulary(gemma=True)
    ),
}


def comparable(config: Any) -> dict[str, Any]:
    """A config's settings, less names and bookkeeping that differ by where it was loaded from."""
    ignored = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "transformers_version", "unk_token_id"}
    return {key: value for key, value in config.to_dict().items() if key not in ignored}
