"""The region of huge pages a model's matmul weights are allocated in (modeling/kernels/huge_pages.py)."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from modeling.model.config import ModelConfig
from modeling.kernels.packing import choose_ops, pack_weights
from modeling.kernels.huge_pages import HugePageRegion
from modeling.model.kv_cache import KVCache
from modeling.model.checkpoint import PROJECTION_PARTS
from modeling.model.decoder import DecoderModel
from modeling.kernels.blocks import ChannelInt8

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads the mappings from /proc")


def mapping_of(address: int) -> dict[str, int]:
    """The /proc/self/smaps fields (kB, or 0/1 flags) of the mapping that holds `address`; "hg" is 1 where the mapping
    asked for huge pages (its own mapping, apart from its neighbours)."""
    fields: dict[str, int] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            low, high = (int(part, 16) for part in head[0].split("-"))
            if inside:
                break
            inside = low <= address < high
        elif inside and head[0].endswith(":") and len(head) > 1 and head[1].isdigit():
            fields[head[0][:-1]] = int(head[1])
        elif inside and head[0] == "VmFlags:":
            fields["hg"] = int("hg" in head[1:])
    assert fields, f"no mapping holds {address:#x}"
    return fields


def test_places_are_whole_pages_in_the_order_asked_for_from_a_huge_page_boundary() -> None:
    region = HugePageRegion([5000, 3 * 4096, 4 << 20])
    first = region.empty((1250,), torch.float32)
    second = region.empty((3, 4096), torch.uint8)
    third = region.empty((1 << 20, 2), torch.bfloat16)
    assert first.data_ptr() % (2 << 20) == 0
    assert [second.data_ptr() - first.data_ptr(), third.data_ptr() - second.data_ptr()] == [2 * 4096, 3 * 4096]
    assert (first.shape, second.shape, third.shape) == ((1250,), (3, 4096), (1 << 20, 2))
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    flags = mapping_of(first.data_ptr())
    if thp.is_file() and "[never]" not in thp.read_text() and "THPeligible" in flags:
        assert flags["THPeligible"] == 1  # the region asked for huge pages, and the kernel would give them


def test_a_full_region_or_another_device_gives_plain_tensors() -> None:
    region = HugePageRegion([4096])
    inside = region.empty((1024,), torch.float32)
    beyond = region.empty((1024,), torch.float32)  # no place left
    assert beyond.data_ptr() != inside.data_ptr() + 4096 and beyond.shape == (1024,)
    assert HugePageRegion([4096], torch.device("meta")).empty((4,), torch.float32).device.type == "meta"
    assert HugePageRegion([]).empty((4,), torch.float32).shape == (4,)
    weight = torch.ones(8)
    assert HugePageRegion.holding([weight]).take(weight).data_ptr() != weight.data_ptr()
    assert HugePageRegion.holding([torch.ones(8, device="meta")]).take(weight) is weight


def test_a_released_place_gives_its_memory_back_and_leaves_the_others() -> None:
    size = 4 << 20
    region = HugePageRegion([size, size])
    kept, dropped = (region.empty((size,), torch.uint8) for _ in range(2))
    kept.fill_(7)
    dropped.fill_(9)
    before = mapping_of(kept.data_ptr())["Rss"]
    assert before >= 2 * size // 1024
    region.release(dropped)
    region.release(torch.ones(1 << 20))  # not the region's: left alone
    assert mapping_of(kept.data_ptr())["Rss"] <= before - size // 1024
    assert bool((kept == 7).all())
    assert int(dropped.sum()) == 0  # the place is still the region's, now fresh zero pages


def test_a_cpu_models_matmul_weights_lie_in_one_region_and_blocks_give_it_back(tiny_llama_folder: Path) -> None:
    """Embeddings and projections are allocated in one mapping, each at a page boundary; once per-channel int8 blocks
    replace them all (the tied LM head included, so the table is read from its blocks), their memory is freed."""
    config = ModelConfig.from_folder(tiny_llama_folder)
    blocks = ChannelInt8(tiny_llama_folder)
    model = DecoderModel(config, torch.bfloat16, ops=choose_ops(config, torch.bfloat16, torch.device("cpu"), blocks))
    weights = [model.embed_tokens] + [getattr(layer, name) for layer in model.layers for name in PROJECTION_PARTS]
    assert all(weight.data_ptr() % 4096 == 0 for weight in weights)
    assert sorted(weight.data_ptr() for weight in weights) == [weight.data_ptr() for weight in weights]
    address = weights[0].data_ptr()
    assert all(mapping_of(weight.data_ptr()) == mapping_of(address) for weight in weights[-2:])
    if not mapping_of(address).get("hg"):
        pytest.skip("this kernel gave the region no mapping of its own (no transparent huge pages)")
    model.load_weights(tiny_llama_folder)
    assert mapping_of(address)["Rss"] > 0
    served = pack_weights(model, blocks)
    assert served.endswith("13 weights from int8 per-channel blocks)"), served
    assert mapping_of(address)["Rss"] == 0


def test_a_cpu_kv_cache_lies_in_huge_pages_zeroed(tiny_llama_folder: Path) -> None:
    config = ModelConfig.from_folder(tiny_llama_folder)
    cache = KVCache(config, num_pages=600, page_size=16, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert cache.keys.shape == cache.values.shape == (config.num_layers, 600, config.num_kv_heads, 16, config.head_dim)
    assert cache.keys.data_ptr() % (2 << 20) == 0 and cache.values.data_ptr() % 4096 == 0
    assert mapping_of(cache.keys.data_ptr()) == mapping_of(cache.values.data_ptr())
    assert not cache.keys.any() and not cache.values.any()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    flags = mapping_of(cache.keys.data_ptr())
    if thp.is_file() and "[never]" not in thp.read_text() and "THPeligible" in flags:
        assert flags["THPeligible"] == 1 and flags["hg"] == 1


def test_a_region_the_kernel_refuses_gives_plain_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under heuristic overcommit one mapping larger than memory is refused, where tensors one by one (never all
    written, like dense weights served from blocks) are not: the region then gives plain tensors."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    region = HugePageRegion([1 << 20])
    tensor = region.empty((1 << 18,), torch.float32)
    assert tensor.shape == (1 << 18,)
    region.release(tensor)  # nothing to give back
    assert int(tensor.fill_(1).sum()) == 1 << 18
