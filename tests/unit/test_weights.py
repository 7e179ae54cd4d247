"""WeightFiles (modeling/model/weights.py): safetensors folders of every layout,
read exactly, cast, in chunks; broken ones named."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench.load_memory import measure
from modeling.model.weights import INDEX_NAME, WeightError, WeightFiles


def some_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(7, 5, generator=g),
        "bf16": torch.randn(3, 4, 2, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "f64": torch.randn(2, 3, generator=g, dtype=torch.float64),
        "i64": torch.arange(-5, 7),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i16": torch.tensor([-3, 300], dtype=torch.int16),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    if hasattr(torch, "float8_e4m3fn"):
        tensors["f8"] = torch.randn(4, generator=g).to(torch.float8_e4m3fn)
    return tensors


def write_shards(folder: Path, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    """Shard files and an index, laid out as transformers writes them."""
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(folder / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    total = sum(t.numel() * t.element_size() for tensors in shards.values() for t in tensors.values())
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def write_raw(path: Path, header: bytes | dict[str, object], data: bytes = b"", length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def assert_reads_exactly(files: WeightFiles, tensors: dict[str, torch.Tensor]) -> None:
    assert files.names() == frozenset(tensors)
    for name, want in tensors.items():
        assert files.shape(name) == tuple(want.shape)
        assert files.dtype(name) == want.dtype
        got = files.read(name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name  # bitwise


# ---------------------------------------------------------------------------- layouts


def test_one_file_reads_every_dtype_exactly(tmp_path: Path) -> None:
    tensors = some_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    assert_reads_exactly(WeightFiles(tmp_path), tensors)


def test_several_files_read_together(tmp_path: Path) -> None:
    tensors = some_tensors()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[:5]}, str(tmp_path / "a.safetensors"))
    save_file({n: tensors[n] for n in names[5:]}, str(tmp_path / "b.safetensors"))
    assert_reads_exactly(WeightFiles(tmp_path), tensors)


def test_shards_named_by_an_index(tmp_path: Path) -> None:
    tensors = some_tensors()
    names = sorted(tensors)
    write_shards(
        tmp_path,
        {
            "model-00001-of-00002.safetensors": {n: tensors[n] for n in names[:6]},
            "model-00002-of-00002.safetensors": {n: tensors[n] for n in names[6:]},
        },
    )
    save_file({"stray": torch.ones(2)}, str(tmp_path / "consolidated.safetensors"))  # the index rules: not read
    assert_reads_exactly(WeightFiles(tmp_path), tensors)


def test_a_folder_transformers_saved_in_shards(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert len(set(index["weight_map"].values())) > 1, "the model should have been sharded"
    assert_reads_exactly(WeightFiles(tmp_path), {k: v.contiguous() for k, v in model.state_dict().items()})


# ---------------------------------------------------------------------------- casts, slices, chunks


@pytest.mark.parametrize(
    ("stored", "served"),
    [
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float32, torch.float16),
    ],
)
def test_reads_cast_as_to_does(tmp_path: Path, stored: torch.dtype, served: torch.dtype) -> None:
    value = (torch.randn(33, 17, generator=torch.Generator().manual_seed(1)) * 100).to(stored)
    save_file({"w": value}, str(tmp_path / "model.safetensors"))
    got = WeightFiles(tmp_path).read("w", served)
    assert got.dtype == served
    assert torch.equal(got, value.to(served))


@pytest.mark.parametrize("served", [torch.float32, torch.bfloat16])
def test_reads_into_row_slices_of_a_fused_tensor(tmp_path: Path, served: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(8, 6, generator=g), torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    save_file({"q": q, "k": k, "v": v}, str(tmp_path / "model.safetensors"))
    files = WeightFiles(tmp_path, chunk_bytes=40)
    qkv = torch.full((16, 6), -1.0, dtype=served)
    files.read_into("q", qkv[0:8])
    files.read_into("k", qkv[8:12])
    files.read_into("v", qkv[12:16])
    assert torch.equal(qkv, torch.cat([q, k, v]).to(served))


@pytest.mark.parametrize("chunk_bytes", [1, 30, 64, 1000])
def test_a_tensor_bigger_than_a_chunk_is_cast_piece_by_piece(tmp_path: Path, chunk_bytes: int) -> None:
    value = torch.randn(37, 29, generator=torch.Generator().manual_seed(3))
    save_file({"big": value}, str(tmp_path / "model.safetensors"))
    files = WeightFiles(tmp_path, chunk_bytes=chunk_bytes)
    assert torch.equal(files.read("big", torch.bfloat16), value.to(torch.bfloat16))
    assert torch.equal(files.read("big", torch.float64), value.to(torch.float64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("served", [torch.float32, torch.bfloat16])
def test_reads_onto_a_cuda_device_through_the_bounce_buffer(tmp_path: Path, served: torch.dtype) -> None:
    value = torch.randn(300, 70, generator=torch.Generator().manual_seed(4))
    save_file({"w": value}, str(tmp_path / "model.safetensors"))
    got = WeightFiles(tmp_path, chunk_bytes=4096).read("w", served, device="cuda")
    assert got.device.type == "cuda"
    assert torch.equal(got.cpu(), value.to(served))


def test_reading_into_an_inference_tensor(tmp_path: Path) -> None:
    value = torch.randn(5, 3)
    save_file({"w": value}, str(tmp_path / "model.safetensors"))
    files = WeightFiles(tmp_path)
    with torch.inference_mode():
        out = torch.empty(5, 3)
        files.read_into("w", out)
    assert torch.equal(out, value)


# ---------------------------------------------------------------------------- what the caller gets wrong


def test_a_wrong_shape_names_the_tensor_and_both_shapes(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(4, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match=r"'w' has shape \(4, 3\).*\(3, 4\)"):
        WeightFiles(tmp_path).read_into("w", torch.empty(3, 4))


def test_an_unknown_name_and_a_strided_destination_are_refused(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(4, 3)}, str(tmp_path / "model.safetensors"))
    files = WeightFiles(tmp_path)
    with pytest.raises(WeightError, match="'nope' is not in"):
        files.shape("nope")
    with pytest.raises(ValueError, match="not contiguous"):
        files.read_into("w", torch.empty(3, 4).t())


# ---------------------------------------------------------------------------- broken folders


def test_a_folder_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightError, match=f"no weight files .* in {re.escape(str(tmp_path))}"):
        WeightFiles(tmp_path)


def test_an_index_naming_a_missing_shard(tmp_path: Path) -> None:
    write_shards(tmp_path, {"model-00001-of-00002.safetensors": {"a": torch.ones(2)}})
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index["weight_map"]["b"] = "model-00002-of-00002.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(WeightError, match=f"{INDEX_NAME} names shard 'model-00002-of-00002.safetensors'"):
        WeightFiles(tmp_path)


def test_an_index_mapping_a_tensor_to_a_shard_without_it(tmp_path: Path) -> None:
    write_shards(tmp_path, {"one.safetensors": {"a": torch.ones(2)}, "two.safetensors": {"b": torch.ones(2)}})
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    index["weight_map"]["b"] = "one.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(WeightError, match=f"{INDEX_NAME} puts weight 'b' in .*one.safetensors, whose header lacks it"):
        WeightFiles(tmp_path)


def test_a_corrupt_index(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    (tmp_path / INDEX_NAME).write_text("{not json")
    with pytest.raises(WeightError, match=f"{INDEX_NAME} is not a readable weight index"):
        WeightFiles(tmp_path)


def test_the_same_tensor_in_two_files(tmp_path: Path) -> None:
    save_file({"a": torch.ones(2), "w": torch.ones(1)}, str(tmp_path / "one.safetensors"))
    save_file({"w": torch.ones(1)}, str(tmp_path / "two.safetensors"))
    with pytest.raises(WeightError, match="'w' is in both .*one.safetensors and .*two.safetensors"):
        WeightFiles(tmp_path)


F32_PAIR = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@pytest.mark.parametrize(
    ("header", "data", "length", "why"),
    [
        (b"", b"", None, "corrupt header"),
        (b"{}", b"", 1 << 40, "header length 1099511627776 does not fit"),
        (b'{"w": ', b"", None, "corrupt header"),
        (b"\xff\xfe{}", b"", None, "corrupt header"),
        (b"[1, 2]", b"", None, "a JSON object was expected"),
        (b'{"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "w": {}}', b"\0" * 4, None, "repeated"),
        ({"w": {**F32_PAIR, "dtype": "Q4"}}, b"\0" * 8, None, "'w' has unknown dtype 'Q4'"),
        ({"w": {**F32_PAIR, "shape": [-2]}}, b"\0" * 8, None, "'w' has shape"),
        ({"w": {**F32_PAIR, "data_offsets": [8, 0]}}, b"\0" * 8, None, "'w' has data_offsets"),
        ({"w": F32_PAIR}, b"\0" * 7, None, r"'w' has data_offsets \[0, 8\] beyond the file's end"),
        ({"w": {**F32_PAIR, "shape": [3]}}, b"\0" * 8, None, "'w' spans 8 bytes"),
        ({"w": "F32"}, b"", None, "'w' is not described by an object"),
    ],
)
def test_a_corrupt_header_names_the_file(
    tmp_path: Path, header: bytes | dict[str, object], data: bytes, length: int | None, why: str
) -> None:
    path = tmp_path / "model.safetensors"
    write_raw(path, header, data, length)
    with pytest.raises(WeightError, match=f"{re.escape(str(path))}.*{why}"):
        WeightFiles(tmp_path)


def test_a_short_file_is_refused_too(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x02\0\0")
    with pytest.raises(WeightError, match="model.safetensors is not a safetensors file"):
        WeightFiles(tmp_path)


def test_a_hand_written_file_with_metadata_reads(tmp_path: Path) -> None:
    header = {"__metadata__": {"format": "pt"}, "w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}
    write_raw(
        tmp_path / "model.safetensors",
        header,
        torch.tensor([1.5, -2.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes(),
    )
    assert torch.equal(WeightFiles(tmp_path).read("w", torch.float32), torch.tensor([1.5, -2.0]))


# ---------------------------------------------------------------------------- peak memory


def test_reading_holds_little_besides_the_weights(tmp_path: Path) -> None:
    """A 200 MB float32 checkpoint in shards, read into bfloat16 and float32 in a fresh process each: the peak
    resident memory above the baseline stays within 1.2x the weights in the serving dtype (plus slack for noise).

    Its largest tensor (64 MB) is big enough that a whole float32 copy of it on the way to
    bfloat16 would break the bound.
    """
    g = torch.Generator().manual_seed(5)
    shards = {
        f"model-0000{i}-of-00004.safetensors": {f"layer{i}.{j}": torch.rand(1024, 1024, generator=g) for j in range(9)}
        for i in range(1, 5)
    }
    shards["model-00001-of-00004.safetensors"]["embed"] = torch.rand(16384, 1024, generator=g)
    del shards["model-00003-of-00004.safetensors"]["layer3.8"], shards["model-00004-of-00004.safetensors"]["layer4.8"]
    write_shards(tmp_path, shards)
    del shards
    for dtype in ("bfloat16", "float32"):
        m = measure(tmp_path, dtype, "reader-only")
        assert m.weights_bytes == (50 << 20) * getattr(torch, dtype).itemsize
        assert m.peak_bytes - m.baseline_bytes <= 1.2 * m.weights_bytes + (32 << 20), m
