"""The native CPU kernels (modeling/kernels/csrc) against plain torch:
attention over the paged cache, the fused elementwise ops."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from modeling.model.decoder import rms_norm

from modeling.model.rope import apply_rope
from modeling.kernels.native import SWITCH_ENV, native_ops


@pytest.fixture(scope="module")
def ops():  # type: ignore[no-untyped-def]
    # No skip: CI machines have a C++ compiler, and a build that silently fell back to
    # torch would leave the kernels untested. Only an explicit switch turns them off.
    if os.environ.get(SWITCH_ENV) == "0":
        pytest.skip(f"{SWITCH_ENV}=0")
    return native_ops()


def _reference_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seqs: list[int], positions: list[int]
) -> torch.Tensor:
    """Row n of q `[N, H, D]` over positions 0..positions[n] of sequence seqs[n] of a whole-sequence cache
    `[S, KVH, L, D]`, in float64: `[N, H*D]`."""
    num_heads, dim = q.shape[1], q.shape[2]
    group = num_heads // keys.shape[1]
    rows = []
    for n, (seq, position) in enumerate(zip(seqs, positions)):
        k = keys[seq, :, : position + 1].double().repeat_interleave(group, dim=0)  # [H, L, D]
        v = values[seq, :, : position + 1].double().repeat_interleave(group, dim=0)
        scores = torch.einsum("hd,hld->hl", q[n].double(), k) * dim**-0.5
        rows.append(torch.einsum("hl,hld->hd", torch.softmax(scores, dim=-1), v).reshape(num_heads * dim))
    return torch.stack(rows)


def _cache(
    num_seqs: int, num_kv_heads: int, max_len: int, dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whole sequences `[S, KVH, L, D]`: what a paged cache holds, laid out plainly."""
    generator = torch.Generator().manual_seed(seed)
    shape = (num_seqs, num_kv_heads, max_len, dim)
    return torch.randn(shape, generator=generator).to(dtype), torch.randn(shape, generator=generator).to(dtype)


def _paged(whole: torch.Tensor, page_size: int, seed: int, spare: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences of `whole` `[S, KVH, L, D]` in pages of a pool (shuffled, with `spare` unused pages of noise):
    (pages `[P, KVH, page_size, D]`, block tables `[S, L / page_size]`)."""
    num_seqs, kv_heads, length, dim = whole.shape
    per_seq = length // page_size
    num_pages = num_seqs * per_seq + spare
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_pages, generator=generator)[: num_seqs * per_seq]
    pages = torch.randn(num_pages, kv_heads, page_size, dim, generator=generator).to(whole.dtype)
    tables = order.view(num_seqs, per_seq)
    chunks = whole.view(num_seqs, kv_heads, per_seq, page_size, dim).transpose(1, 2)  # [S, per_seq, KVH, page, D]
    pages[tables.reshape(-1)] = chunks.reshape(-1, kv_heads, page_size, dim)
    return pages, tables


def _attend(ops, q, keys, values, seqs, positions, page_size: int = 16, seed: int = 0, path: str = ""):  # type: ignore[no-untyped-def]
    """The kernel (on `path`, "" for the build's fastest)
    over `keys`, `values` `[S, KVH, L, D]` moved into shuffled pages."""
    paged_keys, tables = _paged(keys, page_size, seed)
    paged_values, _ = _paged(values, page_size, seed)
    return ops.attend(
        q,
        paged_keys,
        paged_values,
        tables,
        torch.as_tensor(seqs),
        torch.as_tensor(positions),
        q.shape[2] ** -0.5,
        path=path,
    )


# The attention kernel's paths; a test of one this build lacks (no AVX512 or AVX2 on this CPU) is skipped.
ATTENTION_PATHS = ["avx512", "avx2", "generic"]


@pytest.fixture(params=ATTENTION_PATHS)
def attention_path(ops, request: pytest.FixtureRequest) -> str:  # type: ignore[no-untyped-def]
    if request.param not in ops.attention_paths():
        pytest.skip(f"this build has no {request.param} attention path")
    return str(request.param)


# (heads, kv heads, head_dim): the default model's shape (the AVX512 and AVX2 paths where the
# CPU has it), other group sizes, and a head_dim only the generic path serves.
SHAPES = [
    (9, 3, 64),
    (8, 2, 64),
    (4, 4, 64),
    (14, 2, 64),
    (12, 2, 64),
    (16, 2, 128),
    (8, 8, 128),
    (8, 2, 16),
    (6, 3, 32),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "dim"), SHAPES)
@pytest.mark.parametrize("page_size", [16, 5, 80])
def test_attention_through_block_tables_matches_the_reference(
    ops,
    attention_path: str,
    dtype: torch.dtype,  # type: ignore[no-untyped-def]
    num_heads: int,
    num_kv_heads: int,
    dim: int,
    page_size: int,
) -> None:
    keys, values = _cache(6, num_kv_heads, 80, dim, dtype, seed=1)
    # Lengths from 1 to past one 16-position block and across page boundaries, a verify-like run of one sequence.
    seqs = [4, 0, 2, 2, 2, 5, 1]
    positions = [0, 15, 30, 31, 32, 16, 79]
    q = torch.randn(len(seqs), num_heads, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = _attend(ops, q, keys, values, seqs, positions, page_size, path=attention_path)
    assert out.shape == (len(seqs), num_heads * dim) and out.dtype == dtype
    tolerance = {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out.double(), _reference_attention(q, keys, values, seqs, positions), **tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "dim"), SHAPES[:2])
def test_each_row_is_computed_alone_wherever_its_pages_lie(
    ops,
    attention_path: str,
    dtype: torch.dtype,  # type: ignore[no-untyped-def]
    num_heads: int,
    num_kv_heads: int,
    dim: int,
) -> None:
    """A row gives bit for bit the same output alone as among others, and whichever pages hold its keys: a verify
    row equals its decode step, and a prefix read from the prefix cache equals one computed in place."""
    keys, values = _cache(8, num_kv_heads, 208, dim, dtype, seed=3)
    seqs = torch.tensor([7, 1, 1, 1, 3, 0, 5, 2])
    positions = torch.tensor([190, 40, 41, 42, 3, 99, 17, 150])
    q = torch.randn(8, num_heads, dim, generator=torch.Generator().manual_seed(4)).to(dtype)
    together = _attend(ops, q, keys, values, seqs, positions, seed=0, path=attention_path)
    for n in range(8):
        alone = _attend(
            ops,
            q[n : n + 1].clone(),
            keys,
            values,
            seqs[n : n + 1],
            positions[n : n + 1],
            seed=n + 1,
            path=attention_path,
        )
        assert torch.equal(alone[0], together[n]), f"row {n} differs alone"


def test_attention_reads_strided_queries(ops) -> None:  # type: ignore[no-untyped-def]
    """Queries sliced out of a fused qkv row (the model's case) give what a contiguous copy gives."""
    keys, values = _cache(3, 3, 48, 64, torch.bfloat16, seed=5)
    qkv = torch.randn(4, 15 * 64).to(torch.bfloat16)
    q = qkv[:, : 9 * 64].view(4, 9, 64)
    seqs, positions = [0, 1, 2, 1], [5, 39, 0, 20]
    assert torch.equal(
        _attend(ops, q, keys, values, seqs, positions), _attend(ops, q.contiguous(), keys, values, seqs, positions)
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "dim"), [shape for shape in SHAPES if shape[2] in (64, 128)])
def test_the_avx512_path_gives_the_avx2_paths_bits(
    ops,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,  # type: ignore[no-untyped-def]
    dim: int,
) -> None:
    """The AVX512 path computes the AVX2 path's sums lane for lane, so a model's steps do not depend on which of
    the two a CPU has; many rows of many lengths, more tasks than threads share out evenly."""
    if not {"avx512", "avx2"} <= set(ops.attention_paths()):
        pytest.skip("this build lacks the avx512 or the avx2 attention path")
    keys, values = _cache(5, num_kv_heads, 208, dim, dtype, seed=11)
    generator = torch.Generator().manual_seed(12)
    seqs = torch.randint(0, 5, (41,), generator=generator)
    positions = torch.randint(0, 208, (41,), generator=generator)
    q = torch.randn(41, num_heads, dim, generator=generator).to(dtype)
    wide = _attend(ops, q, keys, values, seqs, positions, page_size=16, path="avx512")
    narrow = _attend(ops, q, keys, values, seqs, positions, page_size=16, path="avx2")
    assert torch.equal(wide, narrow)


def test_the_path_a_models_heads_take_is_the_kernels_own_choice(ops) -> None:  # type: ignore[no-untyped-def]
    """What the ops line says (attention_path_for) is what attend runs: the path asked for where the vector paths take
    the heads' shape, else the generic loops. The rule is the kernel's own, in one place."""
    fastest = ops.attention_paths()[0]
    assert ops.attention_path_for(9, 3, 64) == fastest  # the embedded model
    assert ops.attention_path_for(32, 8, 128) == fastest
    assert ops.attention_path_for(8, 1, 64) == fastest
    assert ops.attention_path_for(16, 1, 64) == "generic"  # more than 8 query heads a kv head
    assert ops.attention_path_for(8, 4, 256) == "generic"  # Gemma's head_dim
    assert ops.attention_path_for(9, 3, 64, "generic") == "generic"
    with pytest.raises(RuntimeError, match="whole groups"):
        ops.attention_path_for(9, 2, 64)
    # attend, asked for the fastest path, runs the one named:
    # the generic loops for a shape the vector paths do not take.
    for heads, kv_heads, dim in ((8, 1, 64), (16, 1, 64)):
        keys, values = _cache(3, kv_heads, 48, dim, torch.float32, seed=29)
        q = torch.randn(4, heads, dim, generator=torch.Generator().manual_seed(30))
        out = _attend(ops, q, keys, values, [0, 1, 2, 0], [20, 37, 9, 44])
        taken = _attend(
            ops, q, keys, values, [0, 1, 2, 0], [20, 37, 9, 44], path=ops.attention_path_for(heads, kv_heads, dim)
        )
        assert torch.equal(out, taken)


def test_the_attention_paths_are_listed_fastest_first_and_an_unknown_one_is_refused(ops) -> None:  # type: ignore[no-untyped-def]
    paths = ops.attention_paths()
    assert paths[-1] == "generic" and paths == [path for path in ATTENTION_PATHS if path in paths]
    keys, values = _cache(1, 2, 16, 64, torch.float32, seed=13)
    q = torch.randn(1, 4, 64)
    assert torch.equal(_attend(ops, q, keys, values, [0], [9]), _attend(ops, q, keys, values, [0], [9], path=paths[0]))
    with pytest.raises(RuntimeError, match=f"attention path 'avx9' is not one of this build's: {', '.join(paths)}"):
        _attend(ops, q, keys, values, [0], [9], path="avx9")


def test_store_writes_each_row_at_its_page_and_offset(ops) -> None:  # type: ignore[no-untyped-def]
    keys, values = torch.zeros(4, 2, 10, 8), torch.zeros(4, 2, 10, 8)
    kv = torch.randn(3, 6, 8)  # rows of [k heads | v heads | another head], as sliced from qkv
    k, v = kv[:, 0:2], kv[:, 2:4]
    pages, offsets = torch.tensor([3, 0, 3]), torch.tensor([0, 9, 1])
    ops.store(k, v, keys, values, pages, offsets)
    expected_keys, expected_values = torch.zeros_like(keys), torch.zeros_like(values)
    expected_keys[pages, :, offsets] = k
    expected_values[pages, :, offsets] = v
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)


def test_store_of_many_rows_writes_each_at_its_page_and_offset(ops) -> None:  # type: ignore[no-untyped-def]
    """More rows than a thread's block (the threads share them out): every row lands at its own place."""
    keys, values = torch.zeros(12, 3, 16, 64, dtype=torch.bfloat16), torch.zeros(12, 3, 16, 64, dtype=torch.bfloat16)
    places = torch.randperm(12 * 16, generator=torch.Generator().manual_seed(14))[:70]
    pages, offsets = places // 16, places % 16
    kv = torch.randn(70, 6, 64).to(torch.bfloat16)
    ops.store(kv[:, 0:3], kv[:, 3:6], keys, values, pages, offsets)
    expected_keys, expected_values = torch.zeros_like(keys), torch.zeros_like(values)
    expected_keys[pages, :, offsets] = kv[:, 0:3]
    expected_values[pages, :, offsets] = kv[:, 3:6]
    assert torch.equal(keys, expected_keys) and torch.equal(values, expected_values)


@pytest.mark.parametrize(
    ("page", "offset", "message"),
    [(4, 0, "page 4 offset 0 is outside"), (-1, 0, "page -1 offset 0"), (0, 10, "page 0 offset 10 is outside")],
)
def test_out_of_range_stores_are_refused_before_any_write(ops, page: int, offset: int, message: str) -> None:  # type: ignore[no-untyped-def]
    keys, values = torch.zeros(4, 2, 10, 8), torch.zeros(4, 2, 10, 8)
    k = torch.ones(2, 2, 8)
    with pytest.raises(RuntimeError, match=message):
        ops.store(k, k, keys, values, torch.tensor([1, page]), torch.tensor([2, offset]))
    assert not keys.any() and not values.any()


@pytest.mark.parametrize(
    ("tables", "row_table", "position", "message"),
    [
        ([[0, 4]], 0, 2, "block table entry 4 is outside"),
        ([[0, -1]], 0, 2, "block table entry -1 is outside"),
        ([[0, 1]], 1, 2, "block table 1 does not exist"),
        ([[0, 1]], 0, 20, "position 20 is outside its block table's 20 positions"),
    ],
)
def test_attention_outside_the_block_tables_is_refused(
    ops,
    tables: list[list[int]],
    row_table: int,
    position: int,  # type: ignore[no-untyped-def]
    message: str,
) -> None:
    keys, values = torch.zeros(4, 2, 10, 8), torch.zeros(4, 2, 10, 8)
    with pytest.raises(RuntimeError, match=message):
        ops.attend(
            torch.ones(1, 4, 8),
            keys,
            values,
            torch.tensor(tables),
            torch.tensor([row_table]),
            torch.tensor([position]),
            1.0,
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "dim"), SHAPES)
def test_tree_rows_attend_to_their_run_then_their_extra_positions(
    ops,
    attention_path: str,
    dtype: torch.dtype,  # type: ignore[no-untyped-def]
    num_heads: int,
    num_kv_heads: int,
    dim: int,
) -> None:
    """Each row's keys are positions 0..its end and then its extra ones, in order (across pages): bit for bit the row
    of a cache where those keys lie one after another."""
    keys, values = _cache(3, num_kv_heads, 80, dim, dtype, seed=5)
    paged_keys, tables = _paged(keys, 16, seed=9)
    paged_values, _ = _paged(values, 16, seed=9)
    seqs = torch.tensor([1, 1, 1, 2, 0])
    ends = torch.tensor([30, 30, 30, 12, 40])
    extra = torch.tensor([[31, -1, -1], [32, 35, -1], [31, 33, 34], [-1, -1, -1], [41, 60, 79]])
    q = torch.randn(5, num_heads, dim, generator=torch.Generator().manual_seed(6)).to(dtype)
    out = ops.attend_tree(q, paged_keys, paged_values, tables, seqs, ends, extra, dim**-0.5, path=attention_path)
    for n in range(5):
        chosen = list(range(int(ends[n]) + 1)) + [int(e) for e in extra[n] if e >= 0]
        packed_keys, packed_values = keys.clone(), values.clone()  # the row's keys moved to 0, 1, 2, ...
        seq = int(seqs[n])
        packed_keys[seq, :, : len(chosen)] = keys[seq, :, chosen]
        packed_values[seq, :, : len(chosen)] = values[seq, :, chosen]
        plain = _attend(
            ops,
            q[n : n + 1].clone(),
            packed_keys,
            packed_values,
            seqs[n : n + 1],
            [len(chosen) - 1],
            seed=n,
            path=attention_path,
        )
        assert torch.equal(out[n], plain[0]), f"row {n}"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([[5, 4]], "must follow"),  # not ascending
        ([[3, -1]], "must follow"),  # at or before the row's end
        ([[-1, 6]], "must follow"),  # a position after padding
        ([[5, 20]], "must follow"),  # outside the block table
        ([[5, -2]], "padding is -1"),
    ],
)
def test_bad_extra_positions_are_refused(ops, extra: list[list[int]], message: str) -> None:  # type: ignore[no-untyped-def]
    keys, values = torch.zeros(2, 2, 10, 8), torch.zeros(2, 2, 10, 8)
    with pytest.raises(RuntimeError, match=message):
        ops.attend_tree(
            torch.ones(1, 4, 8),
            keys,
            values,
            torch.tensor([[0, 1]]),
            torch.tensor([0]),
            torch.tensor([3]),
            torch.tensor(extra),
            1.0,
        )


def test_attention_refuses_mismatched_inputs(ops) -> None:  # type: ignore[no-untyped-def]
    keys, values = torch.zeros(2, 2, 10, 8), torch.zeros(2, 2, 10, 8)
    table, row, position = torch.tensor([[0]]), torch.tensor([0]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="share a dtype"):
        ops.attend(torch.ones(1, 4, 8, dtype=torch.bfloat16), keys, values, table, row, position, 1.0)
    with pytest.raises(RuntimeError, match="do not fit the cache"):
        ops.attend(torch.ones(1, 3, 8), keys, values, table, row, position, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        ops.attend(torch.ones(1, 4, 8), keys, values, table, row.int(), position, 1.0)


def _close_to_torch(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal up to one rounding step of the dtype (a sum taken in another order may round the other way)."""
    if ours.dtype == torch.bfloat16:
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=2**-7)
        assert (ours != theirs).float().mean() < 0.01
    else:
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 37])
def test_fused_norms_match_torch(ops, dtype: torch.dtype, rows: int) -> None:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(6)
    x = (torch.randn(rows, 576, generator=generator) * 3).to(dtype)
    delta = torch.randn(rows, 576, generator=generator).to(dtype)
    weight = torch.rand(576, generator=generator).to(dtype)
    _close_to_torch(ops.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))
    residual = x.clone()
    normed = ops.add_rms_norm_(residual, delta, weight, 1e-5)
    assert torch.equal(residual, x + delta)  # the add rounds exactly as torch's
    _close_to_torch(normed, rms_norm(x + delta, weight, 1e-5))


def _norm_in_the_written_order(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 rows with the squares summed as the kernel sums them on every build: eight sums over the
    row's whole blocks of 8, then those eight in a tree, then the last squares one by one. In numpy's float32, whose
    every operation rounds once (torch divides by a number as a multiplication by its reciprocal)."""
    f32 = np.float32
    rows = []
    width = x.shape[1]
    blocks = width // 8 * 8
    for row in x.numpy():
        sums = np.zeros(8, dtype=f32)
        for i in range(0, blocks, 8):
            sums = sums + row[i : i + 8] * row[i : i + 8]
        total = ((sums[0] + sums[1]) + (sums[2] + sums[3])) + ((sums[4] + sums[5]) + (sums[6] + sums[7]))
        for i in range(blocks, width):
            total = total + row[i] * row[i]
        inverse = f32(1.0) / np.sqrt(total / f32(width) + f32(eps))
        rows.append(weight.numpy() * (row * inverse))
    return torch.from_numpy(np.stack(rows))


@pytest.mark.parametrize("width", [576, 100, 24, 5])
def test_the_norm_sums_its_squares_in_an_order_written_out(ops, width: int) -> None:  # type: ignore[no-untyped-def]
    """The same bits on an AVX512 build (16 squares a vector) as on any other: the order is the kernel's, not the
    compiler's."""
    generator = torch.Generator().manual_seed(26)
    x = torch.randn(32, width, generator=generator) * 3
    weight = torch.rand(width, generator=generator)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), _norm_in_the_written_order(x, weight, 1e-5))


def test_a_float32_norm_weight_on_bfloat16_rows_rounds_once_as_gemma_does(ops) -> None:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(16)
    x = (torch.randn(5, 640, generator=generator) * 3).to(torch.bfloat16)
    delta = torch.randn(5, 640, generator=generator).to(torch.bfloat16)
    weight = 1.0 + torch.randn(640, generator=generator) * 0.1  # Gemma's 1 + w, kept in float32
    x32 = (x + delta).float()
    expected = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * weight).to(torch.bfloat16)
    torch.testing.assert_close(rms_norm(x + delta, weight, 1e-6), expected, atol=0, rtol=0)
    residual = x.clone()
    _close_to_torch(ops.add_rms_norm_(residual, delta, weight, 1e-6), expected)
    _close_to_torch(ops.rms_norm(x + delta, weight, 1e-6), expected)
    # Not Llama's weight * round(x / rms(x)), which rounds twice.
    assert not torch.equal(expected, rms_norm(x + delta, weight.to(torch.bfloat16), 1e-6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_rope_matches_torch_and_leaves_values_alone(ops, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    generator = torch.Generator().manual_seed(7)
    qkv = torch.randn(5, 15 * 64, generator=generator).to(dtype)
    angles = torch.rand(5, 32, generator=generator) * 6
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    rotated = qkv.clone()
    ops.rope_(rotated, cos, sin, 12, 64)
    expected = apply_rope(qkv[:, : 12 * 64].view(5, 12, 64), cos.unsqueeze(1), sin.unsqueeze(1)).reshape(5, -1)
    assert torch.equal(rotated[:, : 12 * 64], expected)  # the same roundings in the same order
    assert torch.equal(rotated[:, 12 * 64 :], qkv[:, 12 * 64 :])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [128, 48])
def test_fused_rope_rounds_specials_as_torch_does(ops, dtype: torch.dtype, head_dim: int) -> None:  # type: ignore[no-untyped-def]
    """Vector lanes (16 dimensions of each half at a time, for a half that many divide) and the scalar loop alike:
    NaNs, infinities and subnormals round as torch's ops round them."""
    generator = torch.Generator().manual_seed(27)
    qkv = torch.randn(4, 3 * head_dim, generator=generator)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-40, -1e-40, 0.0, -0.0, 3e38, 1e-38])
    where = torch.randperm(qkv.numel(), generator=generator)[:60]
    qkv.view(-1)[where] = special[torch.arange(60) % len(special)]
    qkv = qkv.to(dtype)
    angles = torch.rand(4, head_dim // 2, generator=generator) * 6
    cos, sin = torch.cat((angles, angles), -1).cos().to(dtype), torch.cat((angles, angles), -1).sin().to(dtype)
    cos[0, 1], sin[1, 2] = 1e-39, 1e-39  # a subnormal product
    rotated = qkv.clone()
    ops.rope_(rotated, cos, sin, 3, head_dim)
    expected = apply_rope(qkv.view(4, 3, head_dim), cos.unsqueeze(1), sin.unsqueeze(1)).reshape(4, -1)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    same = rotated.view(bits) == expected.view(bits)
    assert torch.all(same | (rotated.isnan() & expected.isnan()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_silu_mul_matches_torch(ops, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    gate_up = (torch.randn(9, 2 * 1536, generator=torch.Generator().manual_seed(8)) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _close_to_torch(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_silu_mul_gives_an_element_the_same_bits_wherever_it_stands(ops, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """Vector lanes (16 at a time on AVX512) and the scalar tail of a row compute alike: rolling a row's elements moves
    them between the two, and moves the outputs with them, bit for bit (specials and extremes included)."""
    generator = torch.Generator().manual_seed(9)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 90.0, -90.0, 3e38])
    gate = torch.cat([special, torch.randn(37 - len(special), generator=generator) * 8])
    up = torch.randn(37, generator=generator)
    rows = [torch.cat([gate.roll(shift), up.roll(shift)]) for shift in (0, 5, 21)]
    out = ops.silu_mul(torch.stack(rows).to(dtype))
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for index, shift in enumerate((5, 21), start=1):
        assert torch.equal(out[index].view(bits), out[0].roll(shift).view(bits))


def test_elementwise_ops_refuse_bad_shapes(ops) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="delta must match"):
        ops.add_rms_norm_(torch.ones(2, 8), torch.ones(3, 8), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.rope_(torch.ones(2, 8), torch.ones(2, 4), torch.ones(2, 4), 3, 4)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.silu_mul(torch.ones(2, 8, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [49152, 1000, 17, 16, 1])
def test_argmax_rows_is_torchs_argmax(ops, width: int, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """The first of equal maxima, a NaN's index when a row has one, infinities and signed zeros as torch has them;
    in the vector lanes and the last few columns alike; bfloat16 logits give their float32 widening's token."""
    generator = torch.Generator().manual_seed(28)
    logits = torch.randn(12, width, generator=generator)
    logits[1] = logits[1].round()  # many ties
    logits[2, width // 2] = float("nan")
    logits[2, -1] = float("nan")
    logits[3] = -float("inf")
    logits[4, width - 1] = float("inf")
    logits[5] = 0.0
    logits[5, width // 3 :] = -0.0
    logits[6, width // 4] = 1e9
    logits[6, -1] = 1e9
    logits[7] = float("nan")
    logits[8, -1] = float("nan")
    logits = logits.to(dtype)
    expected = torch.argmax(logits.float(), dim=-1)
    assert torch.equal(ops.argmax_rows(logits), expected)
    assert torch.equal(ops.argmax_rows(logits[:, :width]), expected)
    wide = torch.cat([logits, torch.zeros(12, 5, dtype=dtype)], dim=1)[
        :, :width
    ]  # rows a stride apart that is not their width
    assert torch.equal(ops.argmax_rows(wide), expected)
    assert ops.argmax_rows(torch.empty(0, width, dtype=dtype)).shape == (0,)


def test_argmax_rows_refuses_what_it_cannot_read(ops) -> None:  # type: ignore[no-untyped-def]
    for bad in (torch.ones(2, 8, dtype=torch.float64), torch.ones(8), torch.ones(2, 0), torch.ones(8, 2).t()):
        with pytest.raises(RuntimeError, match="logits must be"):
            ops.argmax_rows(bad)


def test_turned_off_the_model_runs_on_torch_ops_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from modeling.kernels import native
    from modeling.model.config import ModelConfig
    from modeling.kernels.packing import choose_ops, pack_weights
    from modeling.model.decoder import DecoderModel

    config = ModelConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attention_bias=False,
    )
    monkeypatch.setenv(SWITCH_ENV, "0")
    native._load.cache_clear()
    try:
        model = DecoderModel(config, ops=choose_ops(config, torch.float32, torch.device("cpu")))
        assert pack_weights(model) == f"torch (turned off by {SWITCH_ENV}=0)"
        assert model.native is None
        said = choose_ops(config, torch.float16, torch.device("cpu")).said
        assert said.startswith("torch (no native ops for torch.float16")
    finally:
        native._load.cache_clear()  # the next test builds (or finds) them again


@pytest.mark.timeout(300)
def test_a_build_lock_left_by_a_killed_process_does_not_block_loading(ops) -> None:  # type: ignore[no-untyped-def]
    """torch's build lock is a plain file; one left behind by a process killed mid-build must not hang later starts."""
    from modeling.kernels import native
    from modeling.model.store import default_cache_dir

    stale = default_cache_dir() / "kernels" / native._build_name() / "lock"
    stale.touch()
    native._load.cache_clear()
    try:
        assert native.native_ops() is not None
        assert not stale.exists()
    finally:
        native._load.cache_clear()


def test_a_build_in_the_cache_loads_without_a_compiler(ops, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """What a container image does: kernels built in its build stage, loaded where no compiler is installed."""
    from modeling.kernels import native

    monkeypatch.setattr(native, "_compiler_version", lambda: "")
    native._load.cache_clear()
    try:
        loaded = native.native_ops()
        x = torch.randn(3, 64)
        weight = torch.rand(64)
        assert torch.equal(loaded.rms_norm(x, weight, 1e-5), ops.rms_norm(x, weight, 1e-5))
    finally:
        native._load.cache_clear()


def test_a_build_is_reused_only_whole_and_by_its_own_compiler(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from modeling.kernels.native import _reusable

    library, stamp = tmp_path / "k.so", tmp_path / "compiler.txt"
    assert not _reusable(library, stamp, "g++ 12")
    library.write_bytes(b"")
    assert not _reusable(library, stamp, "g++ 12")  # no stamp: a build cut short
    stamp.write_text("g++ 12")
    assert _reusable(library, stamp, "g++ 12") and _reusable(library, stamp, "")
    assert not _reusable(library, stamp, "g++ 13")  # made again by the compiler at hand


def test_an_x86_level_is_checked_against_the_cpu_and_names_the_build(monkeypatch: pytest.MonkeyPatch) -> None:
    from modeling.kernels import native

    v3 = " ".join(sorted(native.ARCH_LEVELS["x86-64-v3"]))
    monkeypatch.setattr(native, "_cpu_flags", lambda: f"flags : {v3}")
    native._build_name.cache_clear()
    try:
        monkeypatch.setenv(native.ARCH_ENV, "x86-64-v3")
        assert native.kernel_arch() == "x86-64-v3"
        level_name = native._build_name()
        native._build_name.cache_clear()
        monkeypatch.setattr(native, "_cpu_flags", lambda: f"flags : {v3} avx512f")  # another CPU of that level
        assert native._build_name() == level_name
        native._build_name.cache_clear()
        monkeypatch.setenv(native.ARCH_ENV, "native")
        assert native._build_name() != level_name
        monkeypatch.setenv(native.ARCH_ENV, "x86-64-v4")
        with pytest.raises(native.KernelUnavailable, match="this CPU lacks avx512bw, avx512cd, avx512dq, avx512vl"):
            native.kernel_arch()
        monkeypatch.setenv(native.ARCH_ENV, "skylake")
        with pytest.raises(native.KernelUnavailable, match="the choices are native, x86-64-v2, x86-64-v3, x86-64-v4"):
            native.kernel_arch()
        native._load.cache_clear()
        assert isinstance(native._load(), native.KernelUnavailable)  # the model runs on torch ops, saying why
    finally:
        native._build_name.cache_clear()
        native._load.cache_clear()
