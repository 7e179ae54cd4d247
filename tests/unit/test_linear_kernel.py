"""The native linear kernel (modeling/kernels/csrc/linear.cpp) on every instruction set this CPU has:
rows that do not depend
on the step they are in, and the products torch computes.

Which paths run depends on the CPU: each test is parametrised over every path the kernel
knows and skips, saying so, those this CPU lacks (`portable` runs everywhere).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from modeling.model.config import ModelConfig
from modeling.kernels.packing import (
    SWITCH_MARGIN,
    PackedLinear,
    PathTimings,
    choose_ops,
    pack_weights,
    measure_linear_paths,
    same_bits,
)
from modeling.model.decoder import DecoderModel
from modeling.kernels.invariance import linear_rows_problem
from modeling.kernels.native import SWITCH_ENV, native_ops

ALL_PATHS = ("amx", "avx512bf16", "avx512vnni", "avx512f", "avx2", "portable")
# Paths whose bfloat16 weights are summed by AMX tiles, in an order and with roundings of the hardware's own.
TILE_ORDER_PATHS = {"amx"}
# The default model's weights (qkv, o, gate_up, down, LM head) and odd ones: widths that
# are not a multiple of any vector, a single output, a single input.
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
ODD_SHAPES = [(53, 77), (1, 5), (17, 1), (33, 300)]
ROW_COUNTS = [*range(1, 65), 97, 130]


@pytest.fixture(scope="module")
def ops():  # type: ignore[no-untyped-def]
    if os.environ.get(SWITCH_ENV) == "0":
        pytest.skip(f"{SWITCH_ENV}=0")
    return native_ops()


def _linear(ops, path: str) -> PackedLinear:  # type: ignore[no-untyped-def]
    if path not in ops.linear_paths():
        pytest.skip(f"this CPU has no {path} (its paths: {list(ops.linear_paths())})")
    return PackedLinear(ops, path)


def _operands(
    shape: tuple[int, int], num_rows: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    num_out, depth = shape
    weight = (torch.randn(num_out, depth, generator=generator) * 0.05).to(dtype)
    bias = torch.randn(num_out, generator=generator).to(dtype)
    # Rows of different magnitudes, as activations are.
    rows = (torch.randn(num_rows, depth, generator=generator) * torch.rand(num_rows, 1, generator=generator) * 3).to(
        dtype
    )
    return weight, bias, rows


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", MODEL_SHAPES + ODD_SHAPES)
def test_each_row_is_bit_for_bit_the_row_alone(ops, path: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    linear = _linear(ops, path)
    large = shape[0] * shape[1] > 10**7
    counts = [1, 2, 3, 5, 7, 13, 64] if large and path == "portable" else ROW_COUNTS
    weight, bias, rows = _operands(shape, max(counts) + 3, dtype)
    packed = linear.pack(weight)
    alone = torch.cat([linear(rows[r : r + 1], packed, bias) for r in range(rows.shape[0])])
    for count in counts:
        for start in sorted({0, 3}):  # the rows at the front of a step and further in
            together = linear(rows[start : start + count], packed, bias)
            assert torch.equal(together, alone[start : start + count]), (
                f"{count} rows from row {start} differ from each row alone"
            )


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), *ODD_SHAPES])
def test_products_match_torch(ops, path: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """float32: within float32 rounding of a float64 product; bfloat16: the float64 product rounded once, within one
    bfloat16 step (the kernel sums in float32 and rounds the result, as torch's bfloat16 matmul does)."""
    linear = _linear(ops, path)
    weight, bias, rows = _operands(shape, 9, dtype, seed=1)
    ours = linear(rows, linear.pack(weight), bias)
    exact = F.linear(rows.double(), weight.double(), bias.double())
    assert ours.dtype == dtype and ours.shape == exact.shape
    if dtype == torch.float32:
        scale = (rows.double().abs() @ weight.double().abs().T + bias.double().abs()) * shape[1] * 2**-24
        assert bool(((ours.double() - exact).abs() <= scale + 1e-30).all())
    else:
        torch.testing.assert_close(ours.double(), exact.to(torch.bfloat16).double(), rtol=2**-7, atol=1e-3)
    without_bias = linear(rows, linear.pack(weight))
    torch.testing.assert_close(without_bias.double(), F.linear(rows.double(), weight.double()), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "num_rows"), [((75, 130), 11), ((33, 77), 30), ((960, 576), 64), ((49, 601), 5)])
def test_every_path_gives_the_same_bits(ops, dtype: torch.dtype, shape: tuple[int, int], num_rows: int) -> None:  # type: ignore[no-untyped-def]
    """A fused multiply-add rounds once whoever computes it, and so does each of a bfloat16 dot product's two adds,
    so the paths agree exactly (and a worker's output does not depend on which one its CPU picked): odd depths
    (a last k without its pair) and depths past one block of k (256) included. For bfloat16 weights, the paths
    `same_bits` keeps together agree even on inputs below float32's normal range, which AVX512-BF16 reads as zero."""
    weight, bias, rows = _operands(shape, num_rows, dtype, seed=2)
    tiny = torch.full_like(rows[:2], 3e-39)  # subnormal, in float32 and in bfloat16, without a bias to hide them
    tiny[1, 1::2] = 0.0

    def both(linear: PackedLinear) -> torch.Tensor:
        packed = linear.pack(weight)
        return torch.cat([linear(rows, packed, bias), linear(tiny, packed)])

    outputs = {path: both(PackedLinear(ops, path)) for path in ops.linear_paths()}
    paths = list(outputs)
    families = {same_bits(paths[i:], dtype, None) for i in range(len(paths))}  # float32: every path in the first
    first = outputs[paths[0]]
    for family in families:
        assert all(torch.equal(outputs[family[0]], outputs[path]) for path in family), family
        # AMX sums bfloat16 weights in its own order: the others' bits within a bfloat16 step (its sums are checked
        # against the exact ones by test_amx_sums_bfloat16_within_float32_rounding).
        torch.testing.assert_close(outputs[family[0]].double(), first.double(), rtol=2**-7, atol=1e-3)


def _chain(rows: torch.Tensor, weight: torch.Tensor, order: list[int]) -> torch.Tensor:
    """Each output as one float32 chain of fused multiply-adds over k in `order`, from zero: a bfloat16 product is
    exact in float32 and the float64 sum of it and a float32 sum is exact here, so rounding that sum once to float32
    is what one fused multiply-add gives."""
    x, w = rows.double(), weight.double()
    acc = torch.zeros(rows.shape[0], weight.shape[0], dtype=torch.float32)
    for k in order:
        acc = (acc.double() + x[:, k : k + 1] * w[:, k]).float()
    return acc


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("depth", [130, 77])
def test_bfloat16_weights_sum_each_pair_of_k_second_first(ops, path: str, depth: int) -> None:  # type: ignore[no-untyped-def]
    """The chain linear_tiles.h defines for bfloat16 weights: k = 1, 0, 3, 2, ..., an odd depth's last k alone (the
    order an AVX512-BF16 dot product adds a pair in), not k = 0, 1, 2, ...; the sums rounded once to bfloat16."""
    if path in TILE_ORDER_PATHS:
        pytest.skip(f"{path} sums in its tiles' own order (test_amx_sums_bfloat16_within_float32_rounding)")
    linear = _linear(ops, path)
    weight, _, rows = _operands((37, depth), 6, torch.bfloat16, seed=3)
    ours = linear(rows, linear.pack(weight))
    pairs = [k for j in range(0, depth - 1, 2) for k in (j + 1, j)] + ([depth - 1] if depth % 2 else [])
    assert torch.equal(ours, _chain(rows, weight, pairs).to(torch.bfloat16))
    # Products 1, 0, 0.75 of 1's float32 step, -1: k in order gives one step (1 + 0.75 step rounds up), k = 1, 0, 3, 2
    # gives 0.75 step. Both are bfloat16 values, so the output tells the orders apart.
    pad = [0.0] * (depth - 4)
    one_weight = torch.tensor([[1.0, 1.0, 2.0**-24, 1.0, *pad]], dtype=torch.bfloat16)
    one_row = torch.tensor([[1.0, 0.0, 1.5, -1.0, *pad]], dtype=torch.bfloat16)
    assert linear(one_row, linear.pack(one_weight)).item() == 1.5 * 2.0**-24 != 2.0**-23


@pytest.mark.parametrize("shape", [(37, 130), (53, 77), (960, 576), (576, 1536)])
def test_amx_sums_bfloat16_within_float32_rounding(ops, shape: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """AMX's tdpbf16ps adds 32 products at a time in an order and with roundings of its own (no chain of single
    roundings gives its bits), so its outputs are held to the rounding a float32 sum of K products can have, at
    most K float32 steps of the sum of |x * w|, plus the one rounding to bfloat16: half a bfloat16 step."""
    linear = _linear(ops, "amx")
    weight, bias, rows = _operands(shape, 40, torch.bfloat16, seed=4)
    ours = linear(rows, linear.pack(weight), bias).double()
    exact = F.linear(rows.double(), weight.double(), bias.double())
    summed = rows.double().abs() @ weight.double().abs().T + bias.double().abs()
    assert bool(((ours - exact).abs() <= summed * shape[1] * 2**-24 + exact.abs() * 2**-8 + 1e-30).all())


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(96, 576), (53, 77), (17, 1)])
def test_rows_of_a_packed_weight_are_the_weight_rows(
    ops, path: str, dtype: torch.dtype, shape: tuple[int, int]
) -> None:  # type: ignore[no-untyped-def]
    """A tied LM head's embedding lookup reads rows back out of the packed head, in whatever layout the path packs
    (AMX: bfloat16 pairs of k side by side), an odd depth's last k included; packing in place gives the same."""
    linear = _linear(ops, path)
    weight, _, _ = _operands(shape, 1, dtype, seed=5)
    ids = torch.tensor([0, shape[0] - 1, shape[0] // 2, 0])
    assert torch.equal(linear.rows(linear.pack(weight), ids), weight[ids])
    in_place = linear.pack(weight.clone(), in_place=True)
    assert torch.equal(in_place, linear.pack(weight)) and torch.equal(linear.rows(in_place, ids), weight[ids])


@pytest.mark.parametrize("shape", [(960, 576), (53, 77)])
def test_amx_rows_of_a_prefill_are_the_rows_alone(ops, shape: tuple[int, int]) -> None:  # type: ignore[no-untyped-def]
    """Past 256 rows the AMX tiles take the rows in blocks (a prefill's): every row still the row alone."""
    linear = _linear(ops, "amx")
    weight, bias, rows = _operands(shape, 600, torch.bfloat16, seed=6)
    packed = linear.pack(weight)
    together = linear(rows, packed, bias)
    for start, count in ((0, 1), (255, 3), (511, 89)):
        assert torch.equal(together[start : start + count], linear(rows[start : start + count], packed, bias))


def test_the_default_path_is_the_fastest_this_cpu_has(ops) -> None:  # type: ignore[no-untyped-def]
    paths = list(ops.linear_paths())
    assert paths[-1] == "portable" and set(paths) <= set(ALL_PATHS)
    assert PackedLinear(ops).path == paths[0]


@pytest.mark.parametrize(
    ("dtype", "block_format"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float32, "q4_1"), (torch.bfloat16, "q8_0")],
)
def test_a_model_runs_on_the_path_measured_fastest(
    ops,
    tiny_llama_folder: Path,
    dtype: torch.dtype,  # type: ignore[no-untyped-def]
    block_format: str | None,
) -> None:
    config = ModelConfig.from_folder(tiny_llama_folder)
    threads = (torch.get_num_threads(), ops.get_num_threads())
    timings = measure_linear_paths(ops, config, dtype, block_format)
    assert (
        torch.get_num_threads(),
        ops.get_num_threads(),
    ) == threads  # the probe runs on one thread, then gives them back
    assert list(timings.seconds) == list(ops.linear_paths())  # every path this CPU has, each timed
    assert all(seconds > 0 for seconds in [*timings.seconds.values(), timings.onednn])
    assert timings.choices == same_bits(list(ops.linear_paths()), dtype, block_format)
    assert timings.fastest == chosen_by(timings.seconds, timings.choices)
    said = str(timings)
    assert said.startswith("measured: ") and all(path in said for path in timings.seconds) and "; oneDNN " in said
    # A model says which path it runs on, and what the probe measured to choose it.
    model = DecoderModel(config, dtype, torch.device("cpu"), choose_ops(config, dtype, torch.device("cpu")))
    model.load_weights(tiny_llama_folder)
    ops_said = pack_weights(model)
    chosen = re.match(r"native \(linear kernel: (\w+), measured: (.+); oneDNN", ops_said)
    assert chosen and isinstance(model.linear, PackedLinear) and model.linear.path == chosen.group(1), ops_said
    # The line rounds the times to two digits, so the choice is checked on the probe's own seconds.
    probe = model.linear.measured
    assert probe is not None and str(probe) in ops_said and list(probe.seconds) == list(ops.linear_paths())
    assert model.linear.path == chosen_by(probe.seconds, probe.choices), ops_said
    assert (
        f"; attention: {ops.attention_path_for(config.num_heads, config.num_kv_heads, config.head_dim)}; " in ops_said
    )


def chosen_by(seconds: dict[str, float], choices: tuple[str, ...]) -> str:
    """The first choice (the widest instruction set) unless another takes at most SWITCH_MARGIN of its time."""
    first, best = choices[0], min(choices, key=lambda path: seconds[path])
    return best if seconds[best] <= SWITCH_MARGIN * seconds[first] else first


def test_bfloat16_weights_run_on_a_path_with_the_first_paths_bits() -> None:
    """AMX sums bfloat16 weights in its own order, and AVX512-BF16's dot products zero what is below float32's normal
    range: on a CPU that has either, a bfloat16 model runs on the first whatever the probe says, so that every process
    there computes the same bits; the other paths share theirs."""
    paths = ["amx", "avx512bf16", "avx512vnni", "avx2", "portable"]
    assert same_bits(paths, torch.bfloat16, None) == ("amx",)
    assert same_bits(paths, torch.float32, None) == tuple(paths)
    assert same_bits(paths, torch.bfloat16, "q4_1") == tuple(paths)
    assert same_bits(paths[1:], torch.bfloat16, None) == ("avx512bf16",)
    assert same_bits(paths[2:], torch.bfloat16, None) == tuple(paths[2:])
    timings = {"amx": 1.0, "avx512bf16": 0.5, "avx2": 0.6, "portable": 3.0}
    assert PathTimings(timings, 1.0, ("amx",)).fastest == "amx"
    assert PathTimings(timings, 1.0, tuple(paths[:2])).fastest == "avx512bf16"


def test_a_narrower_path_must_beat_the_first_clearly() -> None:
    assert PathTimings({"avx2": 1.0, "portable": 0.9}, 1.0).fastest == "avx2"  # noise, not a faster kernel
    assert PathTimings({"avx2": 1.0, "portable": 0.7}, 1.0).fastest == "portable"
    assert PathTimings({"avx512": 1.0, "avx2": 0.5, "portable": 0.6}, 1.0).fastest == "avx2"


def test_the_start_up_probe_passes_here_and_catches_a_kernel_that_depends_on_the_rows(ops) -> None:  # type: ignore[no-untyped-def]
    linear = PackedLinear(ops)
    assert linear_rows_problem(linear, linear.pack, [576, 1536], torch.bfloat16, torch.device("cpu")) is None

    def batched_differently(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        out = linear(x, weight, bias)
        return out + (out * 2**-20 if x.shape[0] >= 8 else 0)  # as a library kernel switching its blocking at 8 rows

    problem = linear_rows_problem(batched_differently, linear.pack, [576], torch.float32, torch.device("cpu"))
    assert problem is not None and "8-row step" in problem


def test_bad_operands_are_refused(ops) -> None:  # type: ignore[no-untyped-def]
    linear = PackedLinear(ops)
    weight, bias, rows = _operands((20, 30), 2, torch.float32)
    packed = linear.pack(weight)
    with pytest.raises(ValueError, match="packed by PackedLinear.pack"):
        linear(rows, weight)
    with pytest.raises(RuntimeError, match="share a dtype"):
        linear(rows.to(torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 30\]"):
        linear(rows[:, :29], packed)
    with pytest.raises(RuntimeError, match="bias"):
        linear(rows, packed, bias[:19])
    with pytest.raises(ValueError, match="not one of this CPU's"):
        PackedLinear(ops, "avx1024")
