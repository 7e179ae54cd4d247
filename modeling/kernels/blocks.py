"""Weight-only quantized linears: a GGUF file's own blocks served as they are, or any model's weights as per-channel
int8, both read by the CPU kernel.

A model converted from a GGUF file keeps the file beside its conversion
(modeling/gguf/convert.py). With `--quantization q4_1` (or q8_0) its projections are served
from that file's Q4_1 (Q8_0) blocks, and its other tensors of a block format the kernel reads
(Q8_0: the embedded model's token embeddings, which are also its tied LM head) from theirs. A Q4_K file's
super-blocks (256 inputs: float16 d and dmin, eight 6-bit scales and mins, 4-bit quants) are
regrouped into sub-blocks of 32 with float32 scales d * scale and -(dmin * min), the
products gguf's dequantization rounds to float32, so they take Q4_1's layout. The kernel
(csrc/linear.cpp) widens a block in registers to exactly the float32 values the conversion
wrote into model.safetensors, so a float32 model computes the same bits from a fifth of the
bytes, and no dequantized copy of a weight is ever held in memory.

With `--quantization int8` any model's projections and LM head are quantized as it loads, one
float16 scale per output channel (d = max |w| / 127, rounded up) and an int8 per weight
(round(w / d)), and laid out as Q8_0 blocks that all carry their row's scale: the kernel widens
them to d * q, the float32 weight they stand for, as it widens a GGUF file's Q8_0 blocks.

Here: the choices, the check that a model can take one (before anything starts), the blocks
of a fused projection under the transformers names, and their regrouping into the kernel's
panels, with its inverse for the rows an embedding lookup reads from a packed tied head.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from common.quantization import GGUF_QUANTIZATIONS, QUANTIZATION_HELP, QUANTIZATIONS
from modeling.gguf.arch import ROPE_FREQS_TENSOR, architecture
from modeling.gguf.convert import GGUF_FILE, hf_tensor_name, unpermute_rope_rows
from modeling.gguf.metadata import GgufConversionError, GgufMetadata
from modeling.model.checkpoint import PROJECTION_PARTS

__all__ = [
    "QUANTIZATIONS",
    "QUANTIZATION_HELP",
    "Blocks",
    "ChannelInt8",
    "GgufBlocks",
    "QuantizationError",
    "block_panels",
    "channel_int8_blocks",
    "panel_rows",
    "q4_k_sub_blocks",
    "servable_quantization",
    "tensor_infos",
    "weight_blocks",
]

QUANT_BLOCK = 32  # inputs per block of the kernel's formats (Q4_K: its sub-blocks)
# The block formats the kernel reads: GGUF type -> (name, bytes per 32 inputs of one output row in the file).
BLOCK_FORMATS = {
    GGMLQuantizationType.Q4_1: ("q4_1", 20),
    GGMLQuantizationType.Q8_0: ("q8_0", 34),
    GGMLQuantizationType.Q4_K: ("q4_k", 18),
}
# Bytes of each scale in the kernel's layout of a format (Q4_K's sub-block scales are float32 products).
SCALE_BYTES = {"q4_1": 2, "q8_0": 2, "q4_k": 4}
_Q4_K_BYTES, _Q4_K_INPUTS = 144, 256  # one Q4_K super-block: d, dmin, 12 bytes of scales and mins, 128 of quants


class QuantizationError(ValueError):
    """A quantization this model cannot take; the message names the choices."""


@dataclass(frozen=True)
class Blocks:
    """One weight (or the rows of a fused one) as GGUF blocks: row r holds output r's `in_features / 32` blocks."""

    format: str  # "q4_1", "q8_0" or "q4_k": the kernel's block format
    rows: np.ndarray  # uint8 [out_features, in_features / 32 * block bytes] (q4_k: `q4_k_sub_blocks`' layout)
    in_features: int


def servable_quantization(folder: Path) -> str:
    """The format all the projections of the model in `folder` are in, if the kernel reads it; else "none"."""
    for quantization in GGUF_QUANTIZATIONS:
        try:
            if GgufBlocks(folder, quantization).complete:
                return quantization
        except QuantizationError:
            continue
    return "none"


def auto_quantization(folder: Path, device: str, dtype: str) -> str:
    """What `--quantization auto` serves the model in `folder` with, on `device` in `dtype`.

    Off the CPU, "none". On a CPU, the model's own GGUF blocks where all its projections have
    them (`servable_quantization`), but for the embedded default in bfloat16 on a CPU with AMX
    tiles: there its dense weights on the kernel's AMX tiles make steps of many rows faster than
    the Q4_1 blocks do (half the time at 64 rows) and serve one request still faster than
    llama.cpp, though the blocks are faster at 1-4 rows (docs/benchmarks.md). Other models keep
    their blocks, whose dense weights would take 3-4x the memory.
    """
    if device != "cpu":
        return "none"
    if dtype == "bfloat16" and cpu_has_amx_tiles() and _is_default_model(folder):
        return "none"
    return servable_quantization(folder)


def cpu_has_amx_tiles() -> bool:
    """Whether this CPU has AMX tiles that the OS lets processes use (torch asks the CPU and the OS)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def _is_default_model(folder: Path) -> bool:
    from modeling.model.store import default_model_dir

    return folder.resolve() == default_model_dir().resolve()


def weight_blocks(folder: Path, quantization: str) -> GgufBlocks | ChannelInt8 | None:
    """Where the blocks `quantization` serves the model in `folder` from come from (None for "none").

    Raises QuantizationError, naming the choices, for an unknown quantization or one the model cannot take; its
    message starts with the quantization, for the caller to put its flag before.
    """
    if quantization not in QUANTIZATIONS:
        raise QuantizationError(f"{quantization!r} is not one of the choices: {', '.join(QUANTIZATIONS)}")
    if quantization == "int8":
        return ChannelInt8(folder)
    return None if quantization == "none" else GgufBlocks(folder, quantization)


class GgufBlocks:
    """The block-quantized tensors of a converted folder's GGUF file, under their transformers names.

    Made for one quantization, a format some of the projections are in; raises QuantizationError
    when none is. Every tensor in a format the kernel reads is served from its blocks, the rest
    dense (`complete`: all projections are in the named format).
    """

    from_file = True  # the blocks are the file's: the model need not read the dense weights they replace

    def __init__(self, folder: Path, quantization: str) -> None:
        self.quantization = quantization
        path = folder / GGUF_FILE
        if not path.is_file():
            raise QuantizationError(
                f"{quantization} serves a model's own GGUF blocks, and {folder} holds no {GGUF_FILE} "
                f"(a Hugging Face folder, or a conversion by an older specserve): the choice for it is none"
            )
        try:
            arch, self._data, infos = tensor_infos(path)
            layout = architecture(GgufMetadata({"general.architecture": arch}))
        except (GgufConversionError, ValueError, struct.error, OSError) as exc:
            raise QuantizationError(
                f"{quantization}: {path} is not a readable GGUF file ({type(exc).__name__}: {exc})"
            ) from exc
        config = json.loads((folder / "config.json").read_text())
        self._heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        self._permuted = layout.rope_rows_permuted
        self._tensors = {
            hf_tensor_name(info.name, layout, arch): info for info in infos if info.name != ROPE_FREQS_TENSOR
        }
        projections = [name for name in self._tensors if name.endswith(tuple(sum(PROJECTION_PARTS.values(), ())))]
        kinds = {self._tensors[name].kind for name in projections}
        servable = sorted(BLOCK_FORMATS[kind][0] for kind in kinds if kind in BLOCK_FORMATS)
        self.complete = servable == [quantization] and len(kinds) == 1
        if quantization not in servable:
            raise QuantizationError(
                f"{quantization} serves a model's own {quantization.upper()} blocks, and the "
                f"projections of {path} are {', '.join(sorted(kind.name for kind in kinds)) or 'not there'}: the "
                f"choices for it are {', '.join(['none', *servable])}"
            )

    def format_of(self, names: list[str]) -> str | None:
        """The block format all the named weights are in, if the kernel reads it; else None."""
        types = {info.kind if (info := self._tensors.get(name)) is not None else None for name in names}
        kind = types.pop() if len(types) == 1 else None
        return BLOCK_FORMATS[kind][0] if kind in BLOCK_FORMATS else None

    def blocks(self, names: list[str], weight: torch.Tensor | None = None) -> Blocks | None:
        """The named weights' blocks, stacked along rows; None unless all are in one block format the kernel reads.

        (`weight`, the fused parameter they replace, is left unread: see `from_file`.)"""
        if (format_name := self.format_of(names)) is None:
            return None
        infos = [self._tensors[name] for name in names]
        parts = []
        for name, info in zip(names, infos):
            rows = info.rows(self._data)  # [out, in / 32 * bytes]: a view of the mapped file
            leaf = name.rsplit(".", 2)[-2]
            if self._permuted and leaf in self._heads:
                rows = unpermute_rope_rows(rows, self._heads[leaf])  # whole rows move: their blocks with them
            parts.append(q4_k_sub_blocks(rows) if info.kind == GGMLQuantizationType.Q4_K else rows)
        in_features = infos[0].shape[0]  # GGUF lists the inner dimension first
        return Blocks(
            format_name, np.ascontiguousarray(np.concatenate(parts) if len(parts) > 1 else parts[0]), in_features
        )


def q4_k_sub_blocks(rows: np.ndarray) -> np.ndarray:
    """Q4_K rows `[N, K / 256 * 144]` -> the kernel's `q4_k` rows `[N, K / 32 * 24]`: for each sub-block of 32
    inputs, float32 d * scale, float32 -(dmin * min), then the 32 quants as Q4_1 packs them (byte j: input j in
    its low nibble, input j + 16 in its high one). d * scale * q - dmin * min is then Q4_1's d * q + m, each
    operation rounded as gguf's dequantization rounds it."""
    num_rows = rows.shape[0]
    blocks = rows.reshape(-1, _Q4_K_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    packed_scales = blocks[:, 4:16].reshape(-1, 3, 4)  # 6-bit scales and mins of the 8 sub-blocks, packed
    low, high, rest = packed_scales[:, 0], packed_scales[:, 1], packed_scales[:, 2]
    scales = np.concatenate([low & 0x3F, (rest & 0x0F) | ((low >> 2) & 0x30)], axis=-1).astype(np.float32)  # [B, 8]
    mins = np.concatenate([high & 0x3F, (rest >> 4) | ((high >> 2) & 0x30)], axis=-1).astype(np.float32)
    shifted = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    quants = (
        (shifted & 0x0F).astype(np.uint8).reshape(-1, 8, 32)
    )  # sub-block 2g: bytes 32g..32g+31's low nibbles, 2g+1: high
    out = np.empty((blocks.shape[0], 8, 24), dtype=np.uint8)
    out[..., 0:4] = (d * scales).astype("<f4").view(np.uint8).reshape(-1, 8, 4)
    out[..., 4:8] = (-(dmin * mins)).astype("<f4").view(np.uint8).reshape(-1, 8, 4)
    out[..., 8:] = quants[..., :16] | (quants[..., 16:] << 4)
    return out.reshape(num_rows, -1)


def q4_1_as_q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_1 rows -> the kernel's `q4_k` rows of the same weights (float16 scales widened to float32, exactly)."""
    blocks = rows.reshape(rows.shape[0], -1, 20)
    out = np.empty((*blocks.shape[:2], 24), dtype=np.uint8)
    for at, scale in ((0, blocks[..., 0:2]), (4, blocks[..., 2:4])):
        out[..., at : at + 4] = scale.copy().view(np.float16).astype("<f4").view(np.uint8)
    out[..., 8:] = blocks[..., 4:]
    return out.reshape(rows.shape[0], -1)


class ChannelInt8:
    """Per-channel int8 blocks of a model's own weights, quantized from the dense parameters as it loads.

    Raises QuantizationError when the model cannot take them: a hidden size that is not a whole
    number of 32-input blocks. A weight whose inputs are not (none of a Llama whose hidden size
    is, but for an odd intermediate size) stays dense.
    """

    quantization = "int8"
    from_file = False  # quantized from the dense weights: the model reads them first

    def __init__(self, folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        hidden = config.get("hidden_size")
        if not isinstance(hidden, int) or hidden % QUANT_BLOCK:
            raise QuantizationError(
                f"--quantization int8 packs weights in blocks of {QUANT_BLOCK} inputs, and {folder}'s hidden_size is "
                f"{hidden!r}: the choice for it is none"
            )

    def format_of(self, names: list[str]) -> str | None:
        return "q8_0"

    def blocks(self, names: list[str], weight: torch.Tensor | None = None) -> Blocks | None:
        """The (fused) `weight` the named weights were read into, as per-channel int8 blocks; None if it cannot be."""
        if weight is None or weight.shape[1] % QUANT_BLOCK:
            return None
        try:
            return channel_int8_blocks(weight)
        except QuantizationError as exc:
            raise QuantizationError(f"{', '.join(names)}: {exc}") from exc


def channel_int8_blocks(weight: torch.Tensor) -> Blocks:
    """`[N, K]` (K a multiple of 32) -> one int8 per weight and one float16 scale per output row, as Q8_0 blocks.

    d = max |w| / 127 as a float16, rounded up where rounding to nearest would leave some
    |w| / d above 127; q = round(w / d). The kernel widens q to q * d exactly (a float16 times
    an 8-bit integer is exact in float32), so every weight is off by at most d / 2.
    """
    values = weight.detach().float().cpu().numpy()
    num_out, depth = values.shape
    largest = np.abs(values).max(axis=1)
    with np.errstate(over="ignore"):
        scale = (largest / 127).astype(np.float16)
    scale = np.where(scale.astype(np.float32) * 127 < largest, np.nextafter(scale, np.float16(np.inf)), scale)
    if not np.isfinite(scale).all():
        raise QuantizationError("a weight is not finite, or beyond float16's range times 127: it cannot be int8")
    widened = scale.astype(np.float32)[:, None]
    quotient = np.divide(values, widened, out=np.zeros_like(values), where=widened > 0)
    quants = np.clip(np.rint(quotient), -127, 127).astype(np.int8)
    num_blocks = depth // QUANT_BLOCK
    rows = np.empty((num_out, num_blocks, 2 + QUANT_BLOCK), dtype=np.uint8)
    rows[:, :, :2] = scale.view(np.uint8).reshape(num_out, 1, 2)
    rows[:, :, 2:] = quants.view(np.uint8).reshape(num_out, num_blocks, QUANT_BLOCK)
    return Blocks("q8_0", rows.reshape(num_out, -1), depth)


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists it: the inner dimension first
    offset: int  # of its data in the file

    def rows(self, data: np.ndarray) -> np.ndarray:
        """Its blocks, row by row (a block format's only), as a view of the mapped file `data`."""
        _, block_bytes = BLOCK_FORMATS[self.kind]
        row_bytes = self.shape[0] // QUANT_BLOCK * block_bytes
        num_rows = int(np.prod(self.shape[1:]))
        return data[self.offset : self.offset + num_rows * row_bytes].reshape(num_rows, row_bytes)


# GGUF value types of a fixed size -> bytes; 8 is a string, 9 an array.
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _DEFAULT_ALIGNMENT = 8, 9, 32


def tensor_infos(path: Path) -> tuple[str, np.ndarray, list[TensorInfo]]:
    """A GGUF file's architecture, its bytes (mapped) and its tensors' names, types, shapes and data offsets.

    Only what serving its blocks needs: the metadata (a vocabulary of tens of thousands of
    strings) is stepped over, not decoded, which gguf's reader takes seconds to do.
    """
    data = np.memmap(path, dtype=np.uint8, mode="r")
    view = memoryview(data)  # type: ignore[arg-type]
    at = 0

    def take(fmt: str) -> Any:
        nonlocal at
        values = struct.unpack_from("<" + fmt, view, at)
        at += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string() -> str:
        nonlocal at
        length = take("Q")
        at += length
        return bytes(view[at - length : at]).decode("utf-8")

    def skip(kind: int) -> None:
        nonlocal at
        if kind == _STRING:
            length = take("Q")  # read before `at` is: take moves it
            at += length
        elif kind == _ARRAY:
            element, count = take("IQ")
            if element in _VALUE_BYTES:
                at += count * _VALUE_BYTES[element]
            else:
                for _ in range(count):
                    skip(element)
        else:
            at += _VALUE_BYTES[kind]

    magic, version, num_tensors, num_values = take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"magic {magic!r}, version {version}: not a GGUF file of version 2 or later")
    arch, alignment = "", _DEFAULT_ALIGNMENT
    for _ in range(num_values):
        key, kind = string(), take("I")
        if key == "general.architecture" and kind == _STRING:
            arch = string()
        elif key == "general.alignment" and kind == 4:
            alignment = take("I")
        else:
            skip(kind)
    infos = []
    for _ in range(num_tensors):
        name = string()
        num_dims = take("I")
        dims = struct.unpack_from(f"<{num_dims}Q", view, at)
        at += 8 * num_dims
        kind, offset = take("IQ")
        infos.append((name, GGMLQuantizationType(kind), tuple(int(d) for d in dims), offset))
    start = -(-at // alignment) * alignment
    return arch, data, [TensorInfo(name, kind, dims, start + offset) for name, kind, dims, offset in infos]


def block_panels(blocks: Blocks, panel: int) -> torch.Tensor:
    """GGUF block rows -> the kernel's panels: uint8 `[ceil(N / panel), K / 32, bytes]` (csrc/linear.cpp).

    For panel p and block b: the panel's outputs' float16 scales d (then m for Q4_1), then for each
    of the block's 32 inputs the outputs' quants (Q8_0: one int8 each). Q4_1 (and Q4_K) take
    `panel / 2` bytes an input, byte j holding output j in its low nibble and output j + panel / 2
    in its high one, in groups of 4 inputs 4u .. 4u + 3: for j = 0, 1, ..., the bytes j of inputs
    4u and 4u + 1 in turn, each followed by that of the input 2 further on. So each 16-bit word
    holds 4 quants that a shift and a mask take out into the 16-bit lane they are multiplied in.
    Rows past N (the last panel's padding) are zero blocks: zero weights.
    """
    num_out = blocks.rows.shape[0]
    num_blocks = blocks.in_features // QUANT_BLOCK
    num_panels = -(-num_out // panel)
    raw = np.zeros((num_panels * panel, num_blocks, blocks.rows.shape[1] // num_blocks), dtype=np.uint8)
    raw[:num_out] = blocks.rows.reshape(num_out, num_blocks, -1)
    by_panel = raw.reshape(num_panels, panel, num_blocks, -1).transpose(0, 2, 1, 3)  # [P, blocks, panel, bytes]
    width = SCALE_BYTES[blocks.format]
    if blocks.format == "q8_0":
        scales = by_panel[..., :2]  # d
        quants = by_panel[..., 2:].transpose(0, 1, 3, 2)  # [P, blocks, 32, panel]
    else:  # q4_1, q4_k: d, m, then 16 bytes: input j's quant in byte j's low nibble, input j + 16's in its high one
        scales = np.concatenate(
            [by_panel[..., 0:width], by_panel[..., width : 2 * width]], axis=2
        )  # [P, blocks, 2 * panel, width]
        packed = by_panel[..., 2 * width :]
        values = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).transpose(0, 1, 3, 2)  # [P, blocks, 32, panel]
        half = panel // 2
        quants = values[..., :half] | (values[..., half:] << 4)  # [P, blocks, 32, half]
        # Inputs in fours: for k = 4u + t (t = 0, 1), byte j of k, then byte j of k + 2; then byte j + 1 of each.
        quants = quants.reshape(num_panels, num_blocks, QUANT_BLOCK // 4, 2, 2, half).transpose(0, 1, 2, 5, 4, 3)
    out = np.concatenate(
        [scales.reshape(num_panels, num_blocks, -1), quants.reshape(num_panels, num_blocks, -1)], axis=-1
    )
    return torch.from_numpy(np.ascontiguousarray(out))


def panel_rows(packed: torch.Tensor, format_name: str, panel: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight `block_panels` packed, widened to float32 as gguf dequantizes them: `[len(ids), K]`."""
    chosen = packed[ids // panel]  # [n, blocks, bytes]
    lane = (ids % panel).view(-1, 1, 1)
    n, num_blocks, _ = chosen.shape

    def per_lane(values: torch.Tensor) -> torch.Tensor:  # [n, blocks, lanes ...] -> the id's own lane
        return values.gather(2, lane.expand(n, num_blocks, 1)).squeeze(2)

    width = SCALE_BYTES[format_name]
    scale_type = torch.float16 if width == 2 else torch.float32
    d = per_lane(chosen[..., : width * panel].contiguous().view(scale_type)).float()
    if format_name == "q8_0":
        quants = chosen[..., 2 * panel :].contiguous().view(torch.int8).view(n, num_blocks, QUANT_BLOCK, panel)
        picked = quants.gather(3, lane.unsqueeze(-1).expand(n, num_blocks, QUANT_BLOCK, 1)).squeeze(3)
        return (picked.float() * d.unsqueeze(-1)).reshape(n, -1)
    m = per_lane(chosen[..., width * panel : 2 * width * panel].contiguous().view(scale_type)).float()
    half = panel // 2
    nibbles = (
        chosen[..., 2 * width * panel :]
        .reshape(n, num_blocks, QUANT_BLOCK // 4, half, 2, 2)
        .permute(0, 1, 2, 5, 4, 3)
        .reshape(n, num_blocks, QUANT_BLOCK, half)
    )
    byte = nibbles.gather(3, (lane % half).unsqueeze(-1).expand(n, num_blocks, QUANT_BLOCK, 1)).squeeze(3)
    quants = torch.where((lane >= half).view(-1, 1, 1), byte >> 4, byte & 0x0F)
    return (d.unsqueeze(-1) * quants.float() + m.unsqueeze(-1)).reshape(n, -1)
