"""The tensors of a Hugging Face model folder, read one at a time straight into tensors the caller allocated.

A safetensors file is an 8-byte little-endian header length, a JSON header that maps each
tensor's name to its dtype, shape and byte range (`data_offsets`, relative to the end of the
header; `__metadata__` holds free-form strings), then the tensors' raw little-endian bytes.

The reader parses every header up front and then reads with plain `preadv` calls, never
mmap: mapped pages would count in this process's resident memory, while read pages stay in
the kernel's page cache. A tensor whose file dtype is its destination's, on the CPU, is read
straight into the destination's memory. Any other (a cast, or a CUDA destination) passes
through one bounded bounce buffer, a chunk of the file's bytes at a time, so loading a
float32 checkpoint into a bfloat16 model never holds a float32 copy of a whole tensor.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_CHUNK_BYTES = 16 << 20  # file bytes per bounce-buffer chunk
_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header

# safetensors' dtype names; the float8 ones only where this torch has them.
_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "I16": torch.int16,
        "I32": torch.int32,
        "I64": torch.int64,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F32": torch.float32,
        "F64": torch.float64,
        "C64": torch.complex64,
        "U16": getattr(torch, "uint16", None),
        "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    }.items()
    if dtype is not None
}


class WeightError(ValueError):
    """The weight files are missing, unreadable or inconsistent, or do not match what the caller expects."""


@dataclass(frozen=True)
class _Entry:
    """Where one tensor's bytes lie."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset_bytes: int  # from the start of the file
    num_bytes: int


class WeightFiles:
    """The tensors of a Hugging Face model folder: one model.safetensors, several *.safetensors, or shards named by
    model.safetensors.index.json.

    With an index, its `weight_map` names the tensors and the shard that holds each; without
    one, model.safetensors holds them, or where there is none every *.safetensors file in the
    folder contributes all of its tensors. Every header is
    read and checked here, so a broken folder fails before anything is allocated. Not safe to
    share between threads (one bounce buffer serves every read).
    """

    def __init__(self, folder: Path, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        # The raw bytes are copied as they lie, and safetensors stores little-endian.
        if sys.byteorder != "little":
            raise NotImplementedError("reading safetensors on a big-endian host is not supported")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        self.folder = folder
        self._chunk_bytes = chunk_bytes
        self._bounce: torch.Tensor | None = None  # uint8 [<= max(chunk_bytes, itemsize)], made on first use
        index = folder / INDEX_NAME
        self._entries = _indexed_entries(index) if index.is_file() else _folder_entries(folder)

    def names(self) -> frozenset[str]:
        return frozenset(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name).dtype

    def read(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        """A new tensor holding `name`, in `dtype` (default: the file's) on `device`."""
        entry = self._entry(name)
        out = torch.empty(entry.shape, dtype=dtype or entry.dtype, device=device)
        self.read_into(name, out)
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Fill `out` (contiguous, the tensor's shape, any dtype, CPU or CUDA) with tensor `name`, cast to out.dtype.

        `out` may be a view such as a row range of a fused parameter.
        """
        entry = self._entry(name)
        if tuple(out.shape) != entry.shape:
            raise WeightError(
                f"weight {name!r} has shape {entry.shape} in {entry.path}, "
                f"the tensor to read it into has {tuple(out.shape)}"
            )
        if not out.is_contiguous():
            raise ValueError(f"the tensor to read weight {name!r} into is not contiguous")
        if entry.num_bytes == 0:
            return
        with torch.no_grad():
            flat = out.detach().view(-1)  # [numel]
            with open(entry.path, "rb", buffering=0) as file:
                if out.device.type == "cpu" and out.dtype == entry.dtype:
                    _read_exact(file.fileno(), _bytes_of(flat), entry.offset_bytes, entry.path)
                else:
                    self._read_through_bounce(file.fileno(), entry, flat)

    def _read_through_bounce(self, fd: int, entry: _Entry, flat: torch.Tensor) -> None:
        """Read the file's bytes a chunk at a time into the bounce buffer, and copy (casting) each into its slice."""
        itemsize = entry.dtype.itemsize
        chunk_elements = min(max(1, self._chunk_bytes // itemsize), flat.numel())
        bounce = self._bounce_buffer(chunk_elements * itemsize)  # grows to one chunk, and is kept for the next read
        for start in range(0, flat.numel(), chunk_elements):
            count = min(chunk_elements, flat.numel() - start)
            raw = bounce[: count * itemsize]
            _read_exact(fd, _bytes_of(raw), entry.offset_bytes + start * itemsize, entry.path)
            flat[start : start + count].copy_(raw.view(entry.dtype))

    def _bounce_buffer(self, num_bytes: int) -> torch.Tensor:
        if self._bounce is None or self._bounce.numel() < num_bytes:
            self._bounce = torch.empty(num_bytes, dtype=torch.uint8)
        return self._bounce

    def samples(self, name: str, size: int) -> list[bytes]:
        """The first, middle and last `size` bytes of tensor `name` as stored (all of it when it is shorter)."""
        entry = self._entry(name)
        starts = sorted({0, max(0, (entry.num_bytes - size) // 2), max(0, entry.num_bytes - size)})
        pieces = []
        with open(entry.path, "rb", buffering=0) as file:
            for start in starts:
                piece = bytearray(min(size, entry.num_bytes - start))
                _read_exact(file.fileno(), memoryview(piece), entry.offset_bytes + start, entry.path)
                pieces.append(bytes(piece))
        return pieces

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise WeightError(f"weight {name!r} is not in {self.folder}") from None


def _bytes_of(flat: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous 1-D CPU tensor's memory."""
    return flat.view(torch.uint8).numpy().data


def _read_exact(fd: int, view: memoryview, offset_bytes: int, path: Path) -> None:
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset_bytes + done)
        if count == 0:
            raise WeightError(f"{path} ended at byte {offset_bytes + done}, inside a tensor its header places there")
        done += count


# ---------------------------------------------------------------------------- finding the files


def _folder_entries(folder: Path) -> dict[str, _Entry]:
    """The tensors of `folder`'s model.safetensors, or without one of every *.safetensors file in it (a name in two
    files is an error). Other files beside a model.safetensors (a draft's phrases, say) are not weights."""
    single = folder / SINGLE_NAME
    paths = [single] if single.is_file() else sorted(folder.glob("*.safetensors"))
    if not paths:
        raise WeightError(f"no weight files (*.safetensors or {INDEX_NAME}) in {folder}")
    entries: dict[str, _Entry] = {}
    for path in paths:
        for name, entry in _read_header(path).items():
            if name in entries:
                raise WeightError(f"weight {name!r} is in both {entries[name].path} and {path}")
            entries[name] = entry
    return entries


def _indexed_entries(index: Path) -> dict[str, _Entry]:
    """The tensors `index` maps to shards, each checked against its shard's header."""
    weight_map = _read_weight_map(index)
    headers: dict[str, dict[str, _Entry]] = {}
    for shard in sorted(set(weight_map.values())):
        path = index.parent / shard
        if Path(shard).name != shard or not path.is_file():
            raise WeightError(f"{index} names shard {shard!r}, which is not a file in {index.parent}")
        headers[shard] = _read_header(path)
    entries: dict[str, _Entry] = {}
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            raise WeightError(f"{index} puts weight {name!r} in {index.parent / shard}, whose header lacks it")
        entries[name] = headers[shard][name]
    return entries


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        content = _loads_unique(index.read_bytes())
    except (OSError, ValueError) as exc:
        raise WeightError(f"{index} is not a readable weight index: {exc}") from exc
    weight_map = content.get("weight_map") if isinstance(content, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise WeightError(f"{index} has no weight_map of tensor names to shard files")
    return weight_map


# ---------------------------------------------------------------------------- one file's header


def _read_header(path: Path) -> dict[str, _Entry]:
    """The tensors of one safetensors file, every entry checked against the format and the file's size."""
    try:
        with open(path, "rb") as file:
            size_bytes = os.fstat(file.fileno()).st_size
            prefix = file.read(8)
            header_bytes = int.from_bytes(prefix, "little")
            fits = len(prefix) == 8 and header_bytes <= min(size_bytes - 8, _MAX_HEADER_BYTES)
            raw = file.read(header_bytes) if fits else b""
    except OSError as exc:
        raise WeightError(f"{path} cannot be read: {exc}") from exc
    if not fits:
        raise WeightError(
            f"{path} is not a safetensors file: header length {header_bytes} does not fit its {size_bytes} bytes"
        )
    try:
        header = _loads_unique(raw)
    except ValueError as exc:  # bad UTF-8, bad JSON, a repeated key
        raise WeightError(f"{path} has a corrupt header: {exc}") from exc
    if not isinstance(header, dict):
        raise WeightError(f"{path} has a corrupt header: a JSON object was expected")
    data_start = 8 + header_bytes
    return {
        name: _parse_entry(path, name, info, data_start, size_bytes)
        for name, info in header.items()
        if name != "__metadata__"
    }


def _parse_entry(path: Path, name: str, info: Any, data_start: int, size_bytes: int) -> _Entry:
    def bad(why: str) -> WeightError:
        return WeightError(f"{path} has a corrupt header: tensor {name!r} {why}")

    if not isinstance(info, dict):
        raise bad("is not described by an object")
    dtype = _DTYPES.get(str(info.get("dtype")))
    if dtype is None:
        raise bad(f"has unknown dtype {info.get('dtype')!r}")
    shape, offsets = _int_list(info.get("shape")), _int_list(info.get("data_offsets"))
    if shape is None or any(d < 0 for d in shape):
        raise bad(f"has shape {info.get('shape')!r}, not a list of sizes")
    if offsets is None or len(offsets) != 2 or not 0 <= offsets[0] <= offsets[1]:
        raise bad(f"has data_offsets {info.get('data_offsets')!r}, not [begin, end]")
    begin, end = offsets
    if data_start + end > size_bytes:
        raise bad(f"has data_offsets {offsets} beyond the file's end ({size_bytes - data_start} data bytes)")
    if end - begin != math.prod(shape) * dtype.itemsize:
        raise bad(
            f"spans {end - begin} bytes, its shape {shape} of {info['dtype']} needs {math.prod(shape) * dtype.itemsize}"
        )
    return _Entry(path, dtype, tuple(shape), data_start + begin, end - begin)


def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return value
    return None


def _loads_unique(raw: bytes) -> Any:
    """JSON with every object's keys distinct (a repeated tensor name would otherwise silently win)."""

    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            repeated = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"keys repeated: {repeated}")
        return dict(pairs)

    return json.loads(raw, object_pairs_hook=unique)
