"""GGUF blocks served as they are: the block kernel against gguf's own dequantization, batch invariance, the
regrouping into panels and back, models served from their Q4_1 file, and the quantizations a model cannot take."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig
from modeling.kernels.packing import PackedLinear, block_probe
from modeling.kernels.huge_pages import HugePageRegion
from modeling.model.engine import ModelEngine
from modeling.gguf.convert import convert_gguf
from modeling.kernels.invariance import linear_rows_problem
from modeling.model.checkpoint import PROJECTION_PARTS
from modeling.kernels.native import KernelUnavailable, native_ops
from modeling.kernels import blocks as quantized
from modeling.kernels.blocks import (
    QUANTIZATIONS,
    Blocks,
    QuantizationError,
    channel_int8_blocks,
    panel_rows,
    q4_k_sub_blocks,
    servable_quantization,
    weight_blocks,
)
from specserve.cli import _build_parser
from specserve.stack import StackAddresses, StackConfig, worker_spec
from specserve.up import UpRefused, up_config
from tests.gguf_files import FAMILIES, q4_k_blocks

KINDS = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}
# (out, in): every projection shape of the embedded model, then odd ones (a partial panel, one block, a few).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (5, 32), (17, 64), (33, 96), (100, 160)]


@pytest.fixture(scope="module")
def ops() -> ModuleType:
    try:
        return native_ops()
    except KernelUnavailable as exc:
        pytest.skip(f"native kernels unavailable: {exc}")


def random_blocks(format_name: str, out_features: int, in_features: int, seed: int) -> tuple[Blocks, torch.Tensor]:
    """Blocks of a random weight, and the float32 weight gguf's dequantization gives for them."""
    generator = np.random.default_rng(seed)
    weight = (generator.standard_normal((out_features, in_features)) * 0.05).astype(np.float32)
    rows = quantize(weight, KINDS[format_name])
    return Blocks(format_name, rows, in_features), torch.from_numpy(dequantize(rows, KINDS[format_name]).copy())


def assert_within_the_inputs_rounding(
    served: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """`served` is rows @ weight.T (+ bias) but for the kernel's rounding of each block of 32 inputs to 16 bits:
    off by at most half a step (the block's largest |x| / 32767) times the weights' absolute sum, doubled here to
    cover float32's own rounding, plus float32's rounding of the sums (csrc/linear.cpp)."""
    exact = rows.double() @ weight.double().T + (0 if bias is None else bias.double())
    largest = rows.abs().double().view(rows.shape[0], -1, 32).amax(-1).repeat_interleave(32, dim=1)
    bound = largest @ weight.abs().double().T / 32767 + 1e-6 * (rows.abs().double() @ weight.abs().double().T) + 1e-6
    error = (served.double() - exact).abs()
    assert (error <= bound).all(), float((error / bound).max())


@pytest.mark.parametrize("format_name", sorted(KINDS))
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_blocks_compute_the_dense_weights_gguf_dequantizes_within_the_inputs_rounding_on_every_path(
    ops: ModuleType, format_name: str, out_features: int, in_features: int
) -> None:
    blocks, weight = random_blocks(format_name, out_features, in_features, seed=out_features + in_features)
    rows = torch.randn(13, in_features) * torch.rand(13, 1) * 3
    rows[0] = 0  # a row of zeros: zero scales
    rows[1, :32] *= 1e-38  # a block of subnormals and tiny numbers
    bias = torch.randn(out_features)
    served = {path: PackedLinear(ops, path) for path in ops.linear_paths()}
    results = {path: linear(rows, linear.pack_blocks(blocks), bias) for path, linear in served.items()}
    for path, result in results.items():
        # Integer sums, then the same float32 operations in the same order on every path: the same bits.
        assert torch.equal(result, results["portable"]), path
        assert_within_the_inputs_rounding(result, rows, weight, bias)
    assert torch.equal(results["portable"][0], bias)


def single_rows(in_features: int, seed: int) -> torch.Tensor:
    """Rows to serve one at a time: random; zeros; a block of tiny numbers; blocks whose quants are the integers
    themselves (largest |x| 32767), with both ends of int16's range and every sign of its two bytes (the byte tiles
    split each quant into a high and a low byte); an infinity; a NaN."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(6, in_features, generator=generator) * 3
    rows[1] = 0
    rows[2, :32] *= 1e-38
    edges = torch.tensor([32767.0, -32767, 255, -256, -1, 1, 256, -255, 128, -128, 127, -129, 0, -32512, 32512, -2])
    rows[3] = edges.repeat(in_features // len(edges) + 1)[:in_features]
    rows[3, 16:32] = torch.randint(-32767, 32768, (16,), generator=generator).float()  # largest 32767 from [0:16]
    rows[4, 3] = float("inf")
    rows[5, -1] = float("nan")
    return rows


@pytest.mark.parametrize(
    ("format_name", "out_features", "in_features"),
    [(name, *shape) for name in sorted(KINDS) for shape in SHAPES]
    + [("q4_k", 960, 1536), ("q4_k", 576, 256), ("q4_k", 5, 256), ("q4_k", 33, 512)],
)
def test_a_few_rows_are_the_same_bits_on_every_path_as_in_a_batch(
    ops: ModuleType, format_name: str, out_features: int, in_features: int
) -> None:
    # A few rows take tiles of their own on some paths (the byte tiles of AVX512 VNNI CPUs); each row alone or in
    # a few must give the bits it gets in a larger batch, and those the portable path's.
    if format_name == "q4_k":
        blocks, _ = random_q4_k(out_features, in_features, seed=out_features)
    else:
        blocks, _ = random_blocks(format_name, out_features, in_features, seed=out_features + in_features)
    rows = single_rows(in_features, seed=in_features)
    portable = PackedLinear(ops, "portable")
    batched = portable(rows, portable.pack_blocks(blocks))
    for path in ops.linear_paths():
        linear = PackedLinear(ops, path)
        packed = linear.pack_blocks(blocks)
        for count in (1, 2, 3, 4, 5):
            for first in range(rows.shape[0] - count + 1):
                served = linear(rows[first : first + count], packed)
                expected = batched[first : first + count]
                assert torch.equal(served.view(torch.int32), expected.view(torch.int32)), (
                    path,
                    count,
                    first,
                )  # NaNs too


def test_every_path_rounds_the_inputs_to_the_nearest_quant_ties_to_even(ops: ModuleType) -> None:
    # An identity weight in Q8_0 blocks (each diagonal 127 quants of d): output j is input j's quant times d * 127 and
    # the block's scale, which is 1 where the block's largest |x| is 32767. Ties (k + 0.5) round to the even k on
    # every path, whichever code rounds the inputs there (scalar, AVX2 or AVX512 vectors).
    identity = np.eye(32, dtype=np.float32)
    rows = quantize(identity, KINDS["q8_0"])
    blocks, weight = Blocks("q8_0", rows, 32), torch.from_numpy(dequantize(rows, KINDS["q8_0"]).copy())
    ties = torch.tensor(
        [
            32767.0,
            0.5,
            1.5,
            2.5,
            3.5,
            -0.5,
            -1.5,
            -2.5,
            -3.5,
            100.5,
            101.5,
            -32766.5,
            7.25,
            7.75,
            -7.25,
            -7.75,
            16383.5,
            16384.5,
            0.0,
            -0.0,
            1e-3,
            -1e-3,
            0.4999,
            0.5001,
            2.0,
            -2.0,
            9.5,
            10.5,
            11.5,
            -9.5,
            -10.5,
            -11.5,
        ]
    )
    expected = torch.round(ties)  # torch rounds half to even
    for path in ops.linear_paths():
        linear = PackedLinear(ops, path)
        served = linear(ties.unsqueeze(0), linear.pack_blocks(blocks))[0]
        quants = (served.double() / weight.diagonal().double()).round()
        assert torch.equal(quants, expected.double()), (path, quants[quants != expected.double()])


@pytest.mark.parametrize("format_name", sorted(KINDS))
def test_a_block_of_infinite_or_nan_inputs_gives_nan(ops: ModuleType, format_name: str) -> None:
    blocks, _ = random_blocks(format_name, 20, 64, seed=4)
    rows = torch.randn(3, 64)
    rows[0, 5], rows[1, 40] = float("inf"), float("nan")
    for path in ops.linear_paths():
        linear = PackedLinear(ops, path)
        served = linear(rows, linear.pack_blocks(blocks))
        assert served[:2].isnan().all() and served[2].isfinite().all(), path


@pytest.mark.parametrize("format_name", sorted(KINDS))
def test_bfloat16_rows_are_computed_as_their_float32_values(ops: ModuleType, format_name: str) -> None:
    # bfloat16 rows are rounded to quants straight from their own bits (widened a block at a time), contiguous or not.
    blocks, weight = random_blocks(format_name, 100, 576, seed=3)
    rows = torch.randn(7, 576).to(torch.bfloat16)
    strided = torch.randn(7, 2 * 576).to(torch.bfloat16)[:, 576:]
    for path in ops.linear_paths():
        linear = PackedLinear(ops, path)
        packed = linear.pack_blocks(blocks)
        for x in (rows, strided):
            served = linear(x, packed)
            assert served.dtype == torch.bfloat16
            assert torch.equal(served, linear(x.float(), packed).to(torch.bfloat16)), path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("format_name", sorted(KINDS))
def test_block_kernel_is_batch_invariant(ops: ModuleType, format_name: str, dtype: torch.dtype) -> None:
    for path in ops.linear_paths():
        linear = PackedLinear(ops, path)
        assert (
            linear_rows_problem(linear, block_probe(linear, format_name), [576, 1536], dtype, torch.device("cpu"))
            is None
        ), path


@pytest.mark.parametrize("format_name", sorted(KINDS))
def test_rows_of_packed_blocks_are_gguf_dequantized_rows(ops: ModuleType, format_name: str) -> None:
    blocks, weight = random_blocks(format_name, 37, 96, seed=5)
    linear = PackedLinear(ops)
    ids = torch.tensor([0, 36, 7, 8, 15, 16, 31, 7])
    assert torch.equal(linear.rows(linear.pack_blocks(blocks), ids), weight[ids])


@pytest.mark.parametrize("format_name", sorted(KINDS))
def test_native_block_rows_are_the_reference_rows(ops: ModuleType, format_name: str) -> None:
    blocks, _ = random_blocks(format_name, 45, 160, seed=9)
    packed = PackedLinear(ops).pack_blocks(blocks)
    ids = torch.tensor([44, 0, 15, 16, 8, 7, 31, 32, 44, 3])
    panel = ops.linear_panel_width()
    assert torch.equal(ops.block_rows(packed, ids, format_name), panel_rows(packed, format_name, panel, ids))
    assert ops.block_rows(packed, torch.tensor([], dtype=torch.long), format_name).shape == (0, 160)
    with pytest.raises(RuntimeError, match="outside the weight's 48 packed rows"):
        ops.block_rows(packed, torch.tensor([48]), format_name)


def test_blocks_moved_into_a_huge_page_region_compute_what_they_did(ops: ModuleType) -> None:
    """Packed blocks copied into one region, each at a page boundary in the order given, stay known to the kernel
    (outputs, format, embedding rows) and give the same bits; the memory they left is theirs no more."""
    linear = PackedLinear(ops)
    packed = [
        linear.pack_blocks(random_blocks(name, out, 160, seed=out)[0])
        for name, out in (("q4_1", 45), ("q8_0", 1000), ("q4_1", 16))
    ]
    x = torch.randn(3, 160).to(torch.bfloat16)
    ids = torch.tensor([3, 15])
    before = [(linear(x, weight), linear.rows(weight, ids)) for weight in packed]
    region = HugePageRegion.holding(packed)
    moved = [linear.move(weight, region) for weight in packed]
    assert all(weight.data_ptr() % 4096 == 0 for weight in moved)
    assert [b.data_ptr() - a.data_ptr() for a, b in zip(moved, moved[1:])] == [
        -(-weight.numel() // 4096) * 4096 for weight in packed[:-1]
    ]
    for weight, (outputs, rows) in zip(moved, before):
        assert torch.equal(linear(x, weight), outputs)
        assert torch.equal(linear.rows(weight, ids), rows)
    with pytest.raises(ValueError, match="packed by PackedLinear.pack"):
        linear(x, packed[0])


def test_a_model_served_from_blocks_holds_them_in_one_region_in_step_order(ops: ModuleType, q4_1_folder: Path) -> None:
    engine = ModelEngine(
        q4_1_folder,
        ModelConfig.from_folder(q4_1_folder),
        device="cpu",
        dtype="bfloat16",
        max_len=32,
        num_pages=4,
        quantization="q4_1",
    )
    engine.load()
    model = engine.model
    weights = [getattr(layer, name) for layer in model.layers for name in PROJECTION_PARTS]
    weights = [weight for weight in weights if weight.dtype == torch.uint8]
    assert weights and all(weight.data_ptr() % 4096 == 0 for weight in weights)
    assert all(b.data_ptr() > a.data_ptr() for a, b in zip(weights, weights[1:]))


def random_q4_k(out_features: int, in_features: int, seed: int) -> tuple[Blocks, torch.Tensor]:
    """Random Q4_K super-blocks (random d and dmin too) in the kernel's layout, and gguf's dequantization of them."""
    generator = np.random.default_rng(seed)
    rows = q4_k_blocks(generator, out_features, in_features).reshape(out_features, -1, 144)
    scales = (generator.uniform(1e-4, 4e-3, size=(*rows.shape[:2], 2))).astype(np.float16)  # d, dmin
    rows[..., :4] = scales.view(np.uint8).reshape(*rows.shape[:2], 4)
    rows = rows.reshape(out_features, -1)
    weight = torch.from_numpy(dequantize(rows, GGMLQuantizationType.Q4_K).copy())
    return Blocks("q4_k", q4_k_sub_blocks(rows), in_features), weight


@pytest.mark.parametrize(("out_features", "in_features"), [(960, 1536), (576, 256), (5, 256), (33, 512)])
def test_q4_k_sub_blocks_compute_the_dense_weights_gguf_dequantizes_on_every_path(
    ops: ModuleType, out_features: int, in_features: int
) -> None:
    blocks, weight = random_q4_k(out_features, in_features, seed=out_features)
    rows = torch.randn(11, in_features) * torch.rand(11, 1) * 3
    for path in ops.linear_paths():
        linear = PackedLinear(ops, path)
        packed = linear.pack_blocks(blocks)
        assert torch.equal(linear.rows(packed, torch.arange(out_features)), weight)  # widened exactly as gguf does
        served = linear(rows, packed)
        portable = PackedLinear(ops, "portable")
        assert torch.equal(served, portable(rows, portable.pack_blocks(blocks))), path
        assert_within_the_inputs_rounding(served, rows, weight)
        assert torch.equal(linear(rows.bfloat16(), packed), linear(rows.bfloat16().float(), packed).bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q4_k_kernel_is_batch_invariant(ops: ModuleType, dtype: torch.dtype) -> None:
    for path in ops.linear_paths():
        linear = PackedLinear(ops, path)
        assert linear_rows_problem(linear, block_probe(linear, "q4_k"), [576, 1536], dtype, torch.device("cpu")) is None


def test_refused_block_shapes(ops: ModuleType) -> None:
    blocks, _ = random_blocks("q4_1", 16, 64, seed=1)
    linear = PackedLinear(ops)
    packed = linear.pack_blocks(blocks)
    with pytest.raises(RuntimeError, match="x must be"):
        linear(torch.randn(2, 32), packed)
    with pytest.raises(RuntimeError, match="no block format q5_0 .the kernel's: q4_1, q8_0, q4_k"):
        ops.linear_blocks(torch.randn(2, 64), packed, 16, None, "q5_0")


# ---------------------------------------------------------------- models served from their GGUF file


def q4_1_file(path: Path, projections: GGMLQuantizationType = GGMLQuantizationType.Q4_1) -> Path:
    """A tiny Llama GGUF file laid out as the embedded model's is: Q4_1 (or `projections`) projections, a Q8_0
    output, F16 token embeddings, F32 norms."""
    tiny = FAMILIES["llama"]()
    shape = tiny.shape
    down = np.random.default_rng(1).standard_normal((shape.hidden_size, shape.intermediate_size)) * 0.08

    def kind_of(name: str, kind: GGMLQuantizationType) -> GGMLQuantizationType:
        if name.endswith("norm.weight") or name == "token_embd.weight":
            return kind
        return GGMLQuantizationType.Q8_0 if name == "output.weight" else projections

    tiny.tensors = [
        (name, down.astype(np.float32) if name.endswith("ffn_down.weight") else weight, kind_of(name, kind))
        for name, weight, kind in tiny.tensors
    ]
    return tiny.write(path)


@pytest.fixture(scope="module")
def q4_1_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scratch = tmp_path_factory.mktemp("q4_1")
    return convert_gguf(q4_1_file(scratch / "tiny.gguf"), scratch / "model")


@pytest.fixture(scope="module")
def q8_0_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    scratch = tmp_path_factory.mktemp("q8_0")
    return convert_gguf(q4_1_file(scratch / "tiny.gguf", GGMLQuantizationType.Q8_0), scratch / "model")


def engine(folder: Path, dtype: str, quantization: str) -> ModelEngine:
    built = ModelEngine(
        folder,
        ModelConfig.from_folder(folder),
        device="cpu",
        dtype=dtype,
        num_pages=32,
        max_len=128,
        quantization=quantization,
    )
    built.load()
    built.allocate()
    return built


def greedy(built: ModelEngine, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation of `prompt` and the logits of every step."""
    pages = tuple(range(8))
    logits = built.forward([SeqSpan(pages, 0, prompt, 1)])
    tokens, every = [], [logits]
    for position in range(len(prompt), len(prompt) + steps):
        tokens.append(int(logits[-1].argmax()))
        logits = built.forward([SeqSpan(pages, position, [tokens[-1]], 1)])
        every.append(logits)
    return tokens, torch.cat(every)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["q4_1", "q8_0"])
def test_tiny_model_served_from_its_blocks_computes_its_folder_weights(
    ops: ModuleType, q4_1_folder: Path, q8_0_folder: Path, quantization: str, dtype: str
) -> None:
    folder = q4_1_folder if quantization == "q4_1" else q8_0_folder
    dense, served = engine(folder, dtype, "none"), engine(folder, dtype, quantization)
    # Two layers of four fused projections, and the (untied) Q8_0 head.
    assert served.ops.endswith(
        "8 weights from q4_1 blocks, 1 weights from q8_0 blocks)"
        if quantization == "q4_1"
        else "9 weights from q8_0 blocks)"
    )
    # Q4_1: 20 bytes per 32 weights, Q8_0 34 (the head is Q8_0 in both).
    assert served.linear_weight_bytes() < dense.linear_weight_bytes() * (0.3 if dtype == "float32" else 0.6)
    assert served.self_check() is None
    tokens, logits = greedy(served, [3, 14, 15, 92, 65], 12)
    dense_tokens, dense_logits = greedy(dense, [3, 14, 15, 92, 65], 12)
    if dtype == "float32":  # the folder holds gguf's dequantization; the kernel rounds only the inputs, to 16 bits
        assert_logits_close(logits, dense_logits)
        assert tokens == dense_tokens
    assert not torch.equal(logits, dense_logits)  # it did serve the blocks


# Logits of a model served from its blocks against its float32 folder's, as a share of their largest |z|: the
# inputs' 16-bit rounding (a 65534th of a block's largest |x| at most), carried through every layer.
BLOCK_LOGIT_TOLERANCE = 2e-3


def assert_logits_close(logits: torch.Tensor, reference: torch.Tensor) -> None:
    gap, largest = float((logits - reference).abs().max()), float(reference.abs().max())
    assert gap <= BLOCK_LOGIT_TOLERANCE * largest, (gap, largest)


# Prompts of the kinds users send, none of them used to tune the kernel.
HELD_OUT_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n",
    "Write a haiku about autumn rain.",
    "Q: What is the boiling point of water at sea level?\nA:",
    "Once upon a time, in a quiet harbour town,",
    "SELECT name, COUNT(*) FROM orders",
)
FP32_MARGIN = 1e-3  # as the parity tests': a top-2 margin under it is a near-tie that any rounding may flip


def test_embedded_model_q4_1_greedy_equals_its_float32_folder(ops: ModuleType, default_model_dir: Path) -> None:
    """The embedded model's own Q4_1 blocks at float32 against its converted folder (gguf's dequantization of them,
    float32): the same greedy tokens except where the folder's top-2 logit margin is below 1e-3, and the logits
    within the stated tolerance up to there."""
    dense, served = engine(default_model_dir, "float32", "none"), engine(default_model_dir, "float32", "q4_1")
    from common.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(default_model_dir)
    for text in HELD_OUT_PROMPTS:
        prompt = tokenizer.encode(text)
        tokens, logits = greedy(served, prompt, 24)
        dense_tokens, dense_logits = greedy(dense, prompt, 24)
        agree = next((i for i, (a, b) in enumerate(zip(tokens, dense_tokens)) if a != b), len(tokens))
        if agree < len(tokens):
            top2 = dense_logits[agree].topk(2).values  # row i: the logits token i was chosen from
            assert float(top2[0] - top2[1]) < FP32_MARGIN, (text, agree)
        assert_logits_close(logits[: agree + 1], dense_logits[: agree + 1])


def test_quantization_a_model_cannot_take_is_refused_naming_the_choices(
    tmp_path: Path, tiny_llama_folder: Path, q8_0_folder: Path
) -> None:
    with pytest.raises(QuantizationError, match="not one of the choices: none, q4_1, q8_0, q4_k, int8"):
        weight_blocks(tiny_llama_folder, "q4_0")
    with pytest.raises(QuantizationError, match="holds no model.gguf .*the choice for it is none"):
        weight_blocks(tiny_llama_folder, "q4_1")
    mixed = convert_gguf(FAMILIES["llama"]().write(tmp_path / "mixed.gguf"), tmp_path / "mixed")
    with pytest.raises(
        QuantizationError, match="projections of .* are .*Q4_K.*Q8_0: the choices for it are none, q4_k, q8_0$"
    ):
        weight_blocks(mixed, "q4_1")
    assert servable_quantization(mixed) == "none"  # `up`'s auto takes blocks only where every projection has them
    with pytest.raises(QuantizationError, match="serves a model's own Q4_1 blocks.*the choices for it are none, q8_0$"):
        weight_blocks(q8_0_folder, "q4_1")
    assert weight_blocks(mixed, "none") is None
    with pytest.raises(QuantizationError):  # an engine refuses it before anything is built
        ModelEngine(
            mixed,
            ModelConfig.from_folder(mixed),
            device="cpu",
            dtype="float32",
            num_pages=8,
            max_len=32,
            quantization="q4_1",
        ).load()
    assert QUANTIZATIONS[0] == "none"


def test_a_file_of_mixed_types_serves_its_q4_k_and_q8_0_tensors_from_their_blocks(
    ops: ModuleType, tmp_path: Path
) -> None:
    """A file as llama.cpp's mixed quantizations write them: the tensors of a type the kernel reads come from their
    blocks (here the Q4_K down projections and the Q8_0 head), the rest dense, and float32 logits are the folder's."""
    mixed = convert_gguf(FAMILIES["llama"]().write(tmp_path / "mixed.gguf"), tmp_path / "mixed")
    dense, served = engine(mixed, "float32", "none"), engine(mixed, "float32", "q4_k")
    assert served.ops.endswith("2 weights from q4_k blocks, 1 weights from q8_0 blocks)"), served.ops
    assert served.self_check() is None
    tokens, logits = greedy(served, [3, 14, 15, 92, 65], 12)
    dense_tokens, dense_logits = greedy(dense, [3, 14, 15, 92, 65], 12)
    assert tokens == dense_tokens
    assert_logits_close(logits, dense_logits)


# ---------------------------------------------------------------- per-channel int8, for any model


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int8_blocks_are_one_scale_per_channel_within_half_a_step(
    ops: ModuleType, out_features: int, in_features: int
) -> None:
    generator = torch.Generator().manual_seed(out_features * in_features)
    weight = torch.randn(out_features, in_features, generator=generator) * torch.rand(
        out_features, 1, generator=generator
    )
    weight[out_features // 2] = 0  # an all-zero channel: a zero scale, zero quants
    weight[0, 3] = 40.0  # an outlier sets its own channel's scale only
    blocks = channel_int8_blocks(weight)
    assert blocks.format == "q8_0" and blocks.rows.shape == (out_features, in_features // 32 * 34)
    by_block = blocks.rows.reshape(out_features, in_features // 32, 34)
    scales = by_block[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [out, blocks]
    assert (scales == scales[:, :1]).all()  # every block of a row carries the row's one scale
    largest = weight.abs().amax(dim=1).numpy()
    assert (scales[:, 0] * 127 >= largest).all() and scales[out_features // 2, 0] == 0
    assert (by_block[:, :, 2:].view(np.int8) != -128).all()  # symmetric: -127..127
    rows = torch.randn(9, in_features)
    for path in ops.linear_paths():
        linear = PackedLinear(ops, path)
        packed = linear.pack_blocks(blocks)
        widened = linear.rows(packed, torch.arange(out_features))
        # Off by at most half a step of the channel's scale (and by rounding to float16 nothing more).
        assert ((widened - weight).abs() <= torch.from_numpy(scales[:, :1]) / 2).all()
        # The kernel sums over exactly those weights, but for its rounding of the inputs.
        assert_within_the_inputs_rounding(linear(rows, packed), rows, widened)


def test_int8_refuses_weights_it_cannot_hold() -> None:
    with pytest.raises(QuantizationError, match="not finite"):
        channel_int8_blocks(torch.tensor([[float("nan")] + [0.0] * 31]))
    with pytest.raises(QuantizationError, match="not finite"):
        channel_int8_blocks(torch.full((1, 32), 1e7))  # its scale would be beyond float16


# The stated tolerance: int8 weights are off by up to 1/254 of their channel's largest, and the
# tiny model's logits by up to this much of their own largest.
INT8_LOGIT_TOLERANCE = 0.02


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_int8_logits_are_within_tolerance_of_its_float_weights(
    ops: ModuleType, tiny_llama_folder: Path, dtype: str
) -> None:
    dense, served = engine(tiny_llama_folder, "float32", "none"), engine(tiny_llama_folder, dtype, "int8")
    # Three layers of four fused projections, and the head, tied to the embeddings (read back out of its blocks).
    assert served.ops.endswith("13 weights from int8 per-channel blocks)"), served.ops
    assert served.linear_weight_bytes() < dense.linear_weight_bytes() * 0.3
    assert served.self_check() is None
    prompt = [3, 14, 15, 92, 65, 35, 89, 79]
    sequence = prompt + greedy(served, prompt, 12)[0]  # what it says, read back by both at every position
    logits = served.forward([SeqSpan(tuple(range(8)), 0, sequence, len(sequence))]).float()
    reference = dense.forward([SeqSpan(tuple(range(8)), 0, sequence, len(sequence))])
    gap = float((logits - reference).abs().max())
    assert gap <= INT8_LOGIT_TOLERANCE * float(reference.abs().max()), (gap, float(reference.abs().max()))
    assert gap > 0  # it did serve the int8 weights, not the float ones


def test_int8_is_refused_for_a_hidden_size_not_made_of_blocks(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"hidden_size": 72}')
    with pytest.raises(QuantizationError, match="blocks of 32 inputs.*hidden_size is 72: the choice for it is none"):
        weight_blocks(tmp_path, "int8")


# ---------------------------------------------------------------- choosing it: `specserve up`, the worker, the draft


def up_stack(*flags: str) -> StackConfig:
    return up_config(_build_parser().parse_args(["up", "--device", "cpu", *flags])).stack


def test_up_serves_the_embedded_model_from_its_q4_1_blocks_by_default(
    default_model_dir: Path, q8_0_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quantized, "cpu_has_amx_tiles", lambda: False)
    assert up_stack("--dtype", "bfloat16").quantization == up_stack("--dtype", "float32").quantization == "q4_1"
    assert up_stack("--quantization", "none").quantization == "none"
    stack = up_stack("--insecure-loopback", "--dtype", "bfloat16")
    argv = worker_spec(stack, StackAddresses.pick(stack), 0).argv
    assert argv[argv.index("--quantization") + 1] == "q4_1"
    # On a CPU with AMX tiles the embedded model in bfloat16 serves its dense weights (faster from 16 concurrent
    # requests there); in float32, and any other model, the blocks.
    monkeypatch.setattr(quantized, "cpu_has_amx_tiles", lambda: True)
    assert up_stack("--dtype", "bfloat16").quantization == "none"
    assert up_stack("--dtype", "float32").quantization == "q4_1"
    assert up_stack("--model", str(q8_0_folder), "--dtype", "bfloat16").quantization == "q8_0"
    assert up_stack("--dtype", "bfloat16", "--quantization", "q4_1").quantization == "q4_1"
    from gpu_worker.config import add_arguments, from_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    worker = parser.parse_args(
        ["--model", str(default_model_dir), "--dtype", "bfloat16", "--quantization", "auto", "--insecure-loopback"]
    )
    assert from_arguments(worker).quantization == "none"  # a worker started alone decides as `up` does
    monkeypatch.setattr(quantized, "cpu_has_amx_tiles", lambda: False)
    assert from_arguments(worker).quantization == "q4_1"


def test_up_refuses_a_quantization_before_anything_starts(
    tiny_llama_folder: Path, q8_0_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _build_parser().parse_args(["up", "--quantization", "q3_k"])
    assert (
        "invalid choice: 'q3_k' (choose from 'auto', 'none', 'q4_1', 'q8_0', 'q4_k', 'int8')" in capsys.readouterr().err
    )
    with pytest.raises(UpRefused, match="--quantization q4_1 serves a model's own GGUF blocks.*choice for it is none"):
        up_stack("--model", str(tiny_llama_folder), "--quantization", "q4_1")
    assert up_stack("--model", str(tiny_llama_folder)).quantization == "none"  # auto: it has no blocks
    assert up_stack("--model", str(q8_0_folder)).quantization == "q8_0"  # auto: its projections' own blocks
    assert up_stack("--model", str(tiny_llama_folder), "--quantization", "int8").quantization == "int8"  # any folder


def test_worker_and_draft_refuse_what_their_model_cannot_take(tiny_llama_folder: Path, q4_1_folder: Path) -> None:
    from draft_service.config import add_arguments as draft_arguments
    from draft_service.config import from_arguments as draft_config
    from gpu_worker.config import add_arguments as worker_arguments
    from gpu_worker.config import from_arguments as worker_config

    def parse(add: Callable[[argparse.ArgumentParser], None], *argv: str) -> argparse.Namespace:
        parser = argparse.ArgumentParser()
        add(parser)
        return parser.parse_args([*argv, "--insecure-loopback"])

    with pytest.raises(SystemExit):  # argparse: not one of the choices
        worker_config(parse(worker_arguments, "--model", str(q4_1_folder), "--quantization", "int4"))
    with pytest.raises(ValueError, match="holds no model.gguf"):
        worker_config(parse(worker_arguments, "--model", str(tiny_llama_folder), "--quantization", "q4_1"))
    assert (
        worker_config(parse(worker_arguments, "--model", str(q4_1_folder), "--quantization", "q4_1")).quantization
        == "q4_1"
    )
    assert (
        worker_config(parse(worker_arguments, "--model", str(tiny_llama_folder), "--quantization", "int8")).quantization
        == "int8"
    )
    # auto: what `specserve up` chooses on the worker's device (the compose file's workers)
    from modeling.model.engine import default_dtype

    auto = ("--dtype", "auto", "--quantization", "auto")
    chosen = worker_config(parse(worker_arguments, "--model", str(q4_1_folder), *auto))
    assert (chosen.quantization, chosen.process.dtype) == ("q4_1", default_dtype("cpu"))
    assert worker_config(parse(worker_arguments, "--model", str(tiny_llama_folder), *auto)).quantization == "none"
    assert (
        worker_config(parse(worker_arguments, "--model", str(q4_1_folder), *auto, "--device", "cuda:0")).quantization
        == "none"
    )
    with pytest.raises(ValueError, match="is for a draft model"):
        draft_config(parse(draft_arguments, "--proposer", "ngram", "--quantization", "q4_1"))
    assert (
        draft_config(
            parse(draft_arguments, "--proposer", f"model:{q4_1_folder}", "--quantization", "q4_1")
        ).quantization
        == "q4_1"
    )
    assert (
        draft_config(
            parse(draft_arguments, "--proposer", f"model:{tiny_llama_folder}", "--quantization", "int8")
        ).quantization
        == "int8"
    )


def test_tensor_infos_agree_with_gguf_reader(tmp_path: Path, default_model_dir: Path) -> None:
    from gguf import GGUFReader

    from modeling.kernels.blocks import tensor_infos

    for path in (q4_1_file(tmp_path / "tiny.gguf"), default_model_dir / "model.gguf"):
        arch, data, infos = tensor_infos(path)
        reader = GGUFReader(path)
        assert arch == reader.fields["general.architecture"].contents()
        assert [(info.name, info.kind, info.shape) for info in infos] == [
            (tensor.name, tensor.tensor_type, tuple(int(d) for d in tensor.shape)) for tensor in reader.tensors
        ]
        for info, tensor in zip(infos, reader.tensors):
            if info.kind in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0):
                assert np.array_equal(info.rows(data), tensor.data)
