"""The native CPU kernels applied to a built model: packed linear weights, fused norms, RoPE and attention.

Applied to a built model (the model file stays plain): each projection weight and the
LM head are packed once into the column panels of the native linear kernel
(csrc/linear.cpp), and the model's `linear` becomes that kernel, on whichever of the
CPU's instruction-set paths a probe measured fastest for the model's shapes (they all give
the same bits, so the choice changes only the speed). Its rows, like those
of the other native ops, are computed exactly as they would be alone, whatever else is
in the step: the property greedy speculation and concurrency-independent output rest on
(modeling/kernels/invariance.py checks it at start-up).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from modeling.kernels.blocks import BLOCK_FORMATS, Blocks, ChannelInt8, GgufBlocks, block_panels, q4_1_as_q4_k
from modeling.kernels.huge_pages import HugePageRegion
from modeling.kernels.native import KernelUnavailable, native_ops
from modeling.kernels.threads import one_thread
from modeling.model.checkpoint import head_parts, projection_parts
from modeling.model.config import ModelConfig
from modeling.model.decoder import DecoderModel, ForwardOps

_IN_PLACE_BLOCK_ELEMENTS = 1 << 20  # the scratch of in-place packing: a few MiB
# The path probe: a weight shaped like the model's MLP projections, capped at a few MiB, on the
# row counts of a batch-1 decode step and of a batched one (the kernel's two kinds of tile);
# at least _PROBE_MIN_ROUNDS rounds, more up to _PROBE_MAX_ROUNDS while the probe has taken less
# than _PROBE_SECONDS.
_PROBE_MAX_OUT, _PROBE_MAX_DEPTH, _PROBE_ROWS = 1024, 2048, (1, 16)
_PROBE_MIN_ROUNDS, _PROBE_MAX_ROUNDS, _PROBE_SECONDS = 7, 40, 0.5
SWITCH_MARGIN = 0.8  # another path is chosen over the first only when it takes at most this share of its time
# For bfloat16 weights, the paths whose bits differ from the float32 FMA chain every other path gives, each its own
# family: AMX's tiles sum in an order of their own, and `vdpbf16ps` (the avx512bf16 path) reads inputs below float32's
# normal range as zero and writes such sums as zero, where an FMA keeps them.
BFLOAT16_FAMILIES = {"amx": "amx", "avx512bf16": "avx512bf16"}


def same_bits(paths: Sequence[str], dtype: torch.dtype, block_format: str | None) -> tuple[str, ...]:
    """The paths that give the first path's bits for weights of `dtype` (or in `block_format`): all of them, but
    for bfloat16 weights AMX's tiles and AVX512-BF16's dot products each give bits of their own (BFLOAT16_FAMILIES).
    A model runs on one of these, so that every process on one CPU computes the same bits whatever its probe
    measured: a request moved to another worker, or a runner built again, continues exactly as it would have."""
    if dtype != torch.bfloat16 or block_format is not None:
        return tuple(paths)
    family = BFLOAT16_FAMILIES.get(paths[0], "")
    return tuple(path for path in paths if BFLOAT16_FAMILIES.get(path, "") == family)


def choose_ops(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, blocks: GgufBlocks | ChannelInt8 | None = None
) -> ForwardOps:
    """The ops a model of `config` in `dtype` on `device` runs on: the native CPU kernels where they serve it, on the
    instruction-set path a probe measures fastest for its shapes (and the block format `blocks` hold its projections
    in, if any); torch's otherwise, saying why."""
    if (unavailable := native_unavailable(dtype, device)) is not None:
        return ForwardOps(said=f"torch ({unavailable})")
    ops = native_ops()
    block_format = blocks.format_of(projection_parts(0)["gate_up_proj"]) if blocks is not None else None
    measured = measure_linear_paths(ops, config, dtype, block_format)
    return ForwardOps(PackedLinear(ops, measured.fastest, measured), ops, "native")


def pack_weights(model: DecoderModel, blocks: GgufBlocks | ChannelInt8 | None = None) -> str:
    """Pack a loaded model's linear weights for the native kernels it was built on (a model on torch ops is left as
    it is), and run its layers as one native call where its family allows.

    With `blocks`, every projection and LM head they hold in a block format the kernel reads
    is packed from its GGUF blocks instead (the model left those parameters unread: see
    `served_by_blocks`), or, for per-channel int8, from the blocks they quantize the loaded
    parameter to. Returns which ops the model runs on, and why, for the owner's log.
    """
    linear = model.linear
    if not isinstance(linear, PackedLinear) or model.native is None:
        return model.ops.said
    ops, measured, dtype = model.native, linear.measured, model.embed_tokens.dtype
    formats: dict[str, int] = {}

    def pack(weight: torch.Tensor, parts: list[str]) -> torch.nn.Parameter:
        found = blocks.blocks(parts, weight) if blocks is not None else None
        if found is None:
            packed = linear.pack(weight, in_place=True)
        else:
            name = found.format if blocks is None or blocks.from_file else f"{blocks.quantization} per-channel"
            formats[name] = formats.get(name, 0) + 1
            packed = linear.pack_blocks(found)
        if packed.data_ptr() != weight.data_ptr():  # a copy: the model's own memory for the weight is not read again
            model.release_weight(weight)
        return packed

    with torch.no_grad():
        owners: list[tuple[object, str]] = []
        for index, layer in enumerate(model.layers):
            for name, parts in projection_parts(index).items():
                setattr(layer, name, pack(getattr(layer, name), parts))
                owners.append((layer, name))
        tied = model.lm_head is model.embed_tokens
        model.lm_head = pack(model.lm_head, head_parts(model.config))
        owners.append((model, "lm_head"))
        # Weights in GGUF blocks, in the order a step reads them, into one region of huge pages. Dense ones are
        # packed in place, in the model's own region of huge pages (DecoderModel): a move would hold two copies of
        # the one being copied.
        owners = [(owner, name) for owner, name in owners if getattr(owner, name).dtype == torch.uint8]
        region = HugePageRegion.holding([getattr(owner, name) for owner, name in owners])
        for owner, name in owners:  # each in turn, its old memory freed before the next is copied
            setattr(owner, name, linear.move(getattr(owner, name), region))
        if tied:  # one table for both: embeddings are read back out of the packed LM head
            model.embed_from(functools.partial(_embedding_rows, linear, model.lm_head, dtype))
    fused = model.fuse_layers(linear.projection, linear.path)
    served = ", ".join(f"{count} weights from {name} blocks" for name, count in sorted(formats.items()))
    layers = "layers in one call" if fused else "layers op by op"
    config = model.config
    attention = f"attention: {ops.attention_path_for(config.num_heads, config.num_kv_heads, config.head_dim)}"
    return f"native (linear kernel: {linear.path}, {measured}; {attention}; {layers}{'; ' + served if served else ''})"


@dataclass(frozen=True)
class PathTimings:
    """Seconds of the path probe on each of this CPU's linear kernel paths, and on oneDNN for comparison."""

    seconds: dict[str, float]
    onednn: float
    choices: tuple[str, ...] = ()  # the paths a model may run on (`same_bits`); empty: every path timed

    @property
    def fastest(self) -> str:
        """The fastest of the choices; the first (the widest instruction set) unless another takes at most
        SWITCH_MARGIN of its time: a probe on a busy machine is noisy, and a narrower path is rarely faster."""
        choices = self.choices or tuple(self.seconds)
        first = choices[0]
        best = min(choices, key=lambda path: self.seconds[path])
        return best if self.seconds[best] <= SWITCH_MARGIN * self.seconds[first] else first

    def __str__(self) -> str:  # e.g. "measured: avx2 0.41 ms, portable 3.2 ms; oneDNN 0.39 ms"
        timings = ", ".join(f"{path} {_milliseconds(value)}" for path, value in self.seconds.items())
        return f"measured: {timings}; oneDNN {_milliseconds(self.onednn)}"


def measure_linear_paths(
    ops: ModuleType, config: ModelConfig, dtype: torch.dtype, block_format: str | None
) -> PathTimings:
    """Time each of this CPU's linear kernel paths on a probe shaped like the model's MLP weights, in its dtype or
    block format (decode-step and batched row counts): the model runs on the fastest.

    oneDNN (torch's linear, on the same weight dense) is timed for comparison only: its order of
    summation depends on the number of rows, so it is never chosen (modeling/kernels/invariance.py).
    """
    out = min(_PROBE_MAX_OUT, config.intermediate_size)
    depth = max(32, min(_PROBE_MAX_DEPTH, config.hidden_size) // 32 * 32)
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(out, depth, generator=generator) * 0.05).to(dtype)
    rows = [torch.randn(count, depth, generator=generator).to(dtype) for count in _PROBE_ROWS]
    runs: dict[str, list[Callable[[], object]]] = {}
    dense = weight
    for path in ops.linear_paths():
        linear = PackedLinear(ops, path)
        packed = block_probe(linear, block_format)(weight) if block_format is not None else linear.pack(weight)
        if block_format is not None:
            dense = linear.rows(packed, torch.arange(out)).to(dtype)  # the weight as the blocks widen it
        runs[path] = [functools.partial(linear, x, packed) for x in rows]
    runs[_ONEDNN] = [functools.partial(F.linear, x, dense) for x in rows]
    seconds = _best_seconds(runs)
    return PathTimings(
        {path: value for path, value in seconds.items() if path != _ONEDNN},
        seconds[_ONEDNN],
        same_bits(list(ops.linear_paths()), dtype, block_format),
    )


_ONEDNN = "oneDNN"


def _best_seconds(runs: dict[str, list[Callable[[], object]]]) -> dict[str, float]:
    """Each name's runs timed in turns with the others' (round after round, so that a busy spell of the machine, say
    another process loading, slows all of them alike), each the fastest of its rounds after a first untimed one;
    summed per name.

    On one thread: a call on two depends on how often the other thread gets its core, so while
    another process keeps a core busy (a draft model or a second worker loading beside this one)
    the probe would measure the machine's load, not the paths. One thread's calls are mostly left
    alone, and the fastest of many rounds is the path's own time; the paths' ranking does not
    depend on the threads, since each thread runs the same tiles on its share of the outputs.
    """
    best = {name: [math.inf] * len(calls) for name, calls in runs.items()}
    with one_thread(), torch.inference_mode():
        for calls in runs.values():
            for call in calls:
                call()
        began = time.perf_counter()
        for round_ in range(_PROBE_MAX_ROUNDS):
            if round_ >= _PROBE_MIN_ROUNDS and time.perf_counter() - began > _PROBE_SECONDS:
                break
            for name, calls in runs.items():
                for index, call in enumerate(calls):
                    start = time.perf_counter()
                    call()
                    best[name][index] = min(best[name][index], time.perf_counter() - start)
    return {name: sum(values) for name, values in best.items()}


def _milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.2g} ms" if seconds < 1e-2 else f"{seconds * 1e3:.0f} ms"


def native_unavailable(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why a model of `dtype` on `device` cannot run on the native kernels; None when it can."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return f"no native ops for {dtype} on {device.type}"
    try:
        native_ops()
    except KernelUnavailable as exc:
        return str(exc)
    return None


def block_probe(linear: PackedLinear, format_name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """A plain `[N, K]` weight -> `format_name` blocks packed for `linear` (gguf's own quantizer): the
    batch-invariance probe's `pack` for a model served from blocks."""
    kind = next(kind for kind, (name, _) in BLOCK_FORMATS.items() if name == format_name)

    def pack(weight: torch.Tensor) -> torch.Tensor:
        if kind == GGMLQuantizationType.Q4_K:  # gguf has no Q4_K quantizer: Q4_1's blocks, their scales widened
            return linear.pack_blocks(
                Blocks(
                    format_name,
                    q4_1_as_q4_k(quantize(weight.float().cpu().numpy(), GGMLQuantizationType.Q4_1)),
                    weight.shape[1],
                )
            )
        rows = quantize(weight.float().cpu().numpy(), kind)
        return linear.pack_blocks(Blocks(format_name, rows, weight.shape[1]))

    return pack


def served_by_blocks(model: DecoderModel, blocks: GgufBlocks | ChannelInt8) -> set[str]:
    """The Hugging Face names of the weights `pack_weights` will pack from `blocks`: the model need not read them."""
    if not blocks.from_file:
        return set()
    groups = [parts for index in range(len(model.layers)) for parts in projection_parts(index).values()]
    groups.append(head_parts(model.config))
    return {name for parts in groups if blocks.format_of(parts) is not None for name in parts}


def _embedding_rows(linear: PackedLinear, head: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor) -> torch.Tensor:
    return linear.rows(head, ids).to(dtype)


class PackedLinear:
    """y = x @ W^T (+ b) by the native kernel, on weights packed by `pack` (and only those).

    `path` names the kernel's instruction set (one of `ops.linear_paths()`); by default the
    fastest this CPU has, as the kernel found when it loaded; `measured`, the probe that chose it.
    """

    def __init__(self, ops: ModuleType, path: str | None = None, measured: PathTimings | None = None) -> None:
        paths = list(ops.linear_paths())
        if path is not None and path not in paths:
            raise ValueError(f"linear kernel path {path!r} is not one of this CPU's {paths}")
        self._ops = ops
        self.path = path or paths[0]
        self._panel = int(ops.linear_panel_width())
        self._out_features: dict[int, int] = {}  # packed weight's data pointer -> its rows before packing
        self._formats: dict[int, str] = {}  # packed GGUF blocks' data pointer -> their block format
        self.measured = measured  # the probe that chose `path`, where one did

    def pack(self, weight: torch.Tensor, *, in_place: bool = False) -> torch.nn.Parameter:
        """`[N, K]` -> `[ceil(N / P), K, P]`: column panels of P outputs, the last padded with zero rows of W.

        `in_place` rearranges the weight's own memory where N is a whole number of panels (a
        panel's P rows and its packed form are the same P x K elements), a block of panels at a
        time, and the weight is then the packed tensor: loading a model holds no second copy
        of it. Otherwise the packed tensor is a new one.
        """
        num_out, depth = weight.shape
        panel = self._panel
        full, rest = divmod(num_out, panel)
        if in_place and not rest and weight.is_contiguous():
            packed = self._pack_in_place(weight.detach(), full, depth)
        else:
            packed = torch.empty(full + bool(rest), depth, panel, dtype=weight.dtype, device=weight.device)
            with torch.no_grad():
                if full:
                    packed[:full].copy_(weight[: full * panel].view(full, panel, depth).transpose(1, 2))
                if rest:
                    packed[full].zero_()
                    packed[full, :, :rest].copy_(weight[full * panel :].T)
        if self._in_pairs(packed):
            self._pair_in_place(packed)
        return self._register(packed, num_out)

    def _in_pairs(self, packed: torch.Tensor) -> bool:
        """Whether this path's tiles read `packed` (a dense packed weight) with each pair of k side by side: AMX
        tiles, for bfloat16 weights. A panel's rows k and k + 1 ([2, P]) are then stored as [P, 2], each output's
        two weights adjacent (an odd K's last k stays a plain row of P)."""
        return self.path == "amx" and packed.dtype == torch.bfloat16

    def _pair_in_place(self, packed: torch.Tensor) -> None:
        num_panels, depth, panel = packed.shape
        pairs = depth // 2
        if pairs == 0:
            return
        block = max(1, _IN_PLACE_BLOCK_ELEMENTS // (panel * depth))
        with torch.no_grad():
            for start in range(0, num_panels, block):
                rows = packed[start : start + block, : 2 * pairs]  # each panel's pairs: contiguous
                staged = rows.reshape(-1, pairs, 2, panel).clone()
                rows.view(-1, pairs, panel, 2).copy_(staged.transpose(2, 3))

    def pack_blocks(self, blocks: Blocks) -> torch.nn.Parameter:
        """GGUF blocks -> the kernel's panels of blocks (`modeling.kernels.blocks.block_panels`), read as they are."""
        packed = block_panels(blocks, self._panel)
        self._formats[packed.data_ptr()] = blocks.format
        return self._register(packed, blocks.rows.shape[0])

    def move(self, packed: torch.Tensor, region: HugePageRegion) -> torch.nn.Parameter:
        """A packed weight copied into the next place of `region`, known to the kernel as the original was."""
        moved = region.take(packed)
        if moved.data_ptr() == packed.data_ptr():
            return torch.nn.Parameter(packed, requires_grad=False)
        if (block_format := self._formats.pop(packed.data_ptr(), None)) is not None:
            self._formats[moved.data_ptr()] = block_format
        return self._register(moved, self._out_features.pop(packed.data_ptr()))

    def block_formats(self) -> set[str]:
        """The GGUF block formats of the weights packed so far."""
        return set(self._formats.values())

    def _pack_in_place(self, weight: torch.Tensor, num_panels: int, depth: int) -> torch.Tensor:
        panel = self._panel
        panels = weight.view(num_panels, panel, depth)  # the same memory as [num_panels, depth, panel]
        block = max(1, _IN_PLACE_BLOCK_ELEMENTS // (panel * depth))
        scratch = torch.empty(min(block, num_panels), panel, depth, dtype=weight.dtype, device=weight.device)
        with torch.no_grad():
            for start in range(0, num_panels, block):
                rows = panels[start : start + block]
                staged = scratch[: rows.shape[0]]
                staged.copy_(rows)
                rows.view(-1, depth, panel).copy_(staged.transpose(1, 2))
        return weight.view(num_panels, depth, panel)

    def _register(self, packed: torch.Tensor, num_out: int) -> torch.nn.Parameter:
        self._out_features[packed.data_ptr()] = num_out
        return torch.nn.Parameter(packed, requires_grad=False)

    def rows(self, packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight `packed` was packed from: `[len(ids), K]` (an embedding lookup on a tied head).

        Rows of GGUF blocks come widened to float32, as gguf dequantizes them (`block_rows`, which computes
        what `modeling.kernels.blocks.panel_rows` does, in one native call)."""
        panel = self._panel
        if packed.dtype == torch.uint8:
            rows: torch.Tensor = self._ops.block_rows(packed, ids, self._formats[packed.data_ptr()])
            return rows
        if not self._in_pairs(packed):
            return packed[ids // panel, :, ids % panel]
        num_panels, depth, _ = packed.shape
        pairs = depth // 2
        paired = packed[:, : 2 * pairs].view(num_panels, pairs, panel, 2)[ids // panel, :, ids % panel]
        widened = paired.reshape(len(ids), 2 * pairs)
        return torch.cat([widened, packed[ids // panel, depth - 1 :, ids % panel]], dim=1) if depth % 2 else widened

    def out_features(self, packed: torch.Tensor) -> int:
        try:
            return self._out_features[packed.data_ptr()]
        except KeyError as exc:
            raise ValueError("the native linear kernel takes only weights packed by PackedLinear.pack") from exc

    def projection(self, packed: torch.Tensor) -> tuple[int, str]:
        """A packed weight's outputs and GGUF block format ("" for a dense weight), as the native layers take it."""
        return self.out_features(packed), self._formats.get(
            packed.data_ptr(), ""
        ) if packed.dtype == torch.uint8 else ""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.dtype == torch.uint8:
            blocks: torch.Tensor = self._ops.linear_blocks(
                x, weight, self.out_features(weight), bias, self._formats[weight.data_ptr()], self.path
            )
            return blocks
        out: torch.Tensor = self._ops.linear(x, weight, self.out_features(weight), bias, self.path)
        return out


def packed_for(model: DecoderModel, weight: torch.Tensor) -> torch.Tensor:
    """A weight of the model's owner (a draft head's input projection) in the form `model.linear` takes."""
    if isinstance(model.linear, PackedLinear):
        with torch.no_grad():
            return model.linear.pack(weight)
    return weight
