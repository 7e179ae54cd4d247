"""Our Llama forward pass against transformers' on a tiny random model: prefill, chunked prefill, ragged decode."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE, KVCache, pages_for_slots, slot_pages
from modeling.model.decoder import TORCH_OPS, DecoderModel
from modeling.kernels.packing import choose_ops, pack_weights
from modeling.kernels.native import KernelUnavailable

transformers = pytest.importorskip("transformers")


SLOT_LEN = 2048  # the tests hold whole sequences in fixed slots of pages


def S(slot: int) -> tuple[int, ...]:
    """The block table of fixed slot `slot` (its pages are not contiguous with any other's)."""
    return slot_pages(slot, SLOT_LEN)


def _kv(config: ModelConfig, num_slots: int, dtype: torch.dtype) -> KVCache:
    return KVCache(config, pages_for_slots(num_slots, SLOT_LEN), DEFAULT_PAGE_SIZE, dtype, torch.device("cpu"))


def _held(store: torch.Tensor, slot: int, length: int) -> torch.Tensor:
    """Positions 0..length-1 of a slot's sequence, every layer: `[layers, kv heads, length, head_dim]`."""
    pages = store[:, list(S(slot))]  # [layers, pages, kv heads, page, D]
    return pages.transpose(1, 2).reshape(store.shape[0], store.shape[2], -1, store.shape[4])[:, :, :length]


@pytest.fixture(scope="module")
def tiny_folder(tiny_llama_folder: Path) -> Path:
    return tiny_llama_folder


def _reference_logits(folder: Path, token_ids: list[int]) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with torch.inference_mode():
        return model(torch.tensor([token_ids])).logits[0]  # [T, V]


def _ours(
    folder: Path, num_slots: int = 4, native: str = "torch", dtype: torch.dtype = torch.float32
) -> tuple[DecoderModel, KVCache]:
    config = ModelConfig.from_folder(folder)
    ops = TORCH_OPS if native == "torch" else choose_ops(config, dtype, torch.device("cpu"))
    model = DecoderModel(config, dtype, ops=ops)
    model.load_weights(folder)
    model.set_rope_cache(128)
    if native != "torch":
        assert pack_weights(model).startswith("native")
    return model, _kv(config, num_slots, dtype)


def _step(model: DecoderModel, cache: KVCache, spans: list[SeqSpan]) -> torch.Tensor:
    with torch.inference_mode():
        batch = model.plan(spans, cache.page_size)
        return model.logits(model(batch, cache)[batch.logit_rows])


# Every reference test runs on torch ops alone and on the native kernels (modeling/kernels/csrc).
ops_paths = pytest.mark.parametrize("native", ["torch", "native"])


@ops_paths
def test_prefill_matches_reference(tiny_folder: Path, native: str) -> None:
    tokens = [5, 17, 3, 88, 42, 7, 7, 1, 60]
    model, cache = _ours(tiny_folder, native=native)
    ours = _step(model, cache, [SeqSpan(S(2), start=0, token_ids=tokens, num_logits=len(tokens))])
    torch.testing.assert_close(ours, _reference_logits(tiny_folder, tokens), atol=1e-4, rtol=1e-4)


@ops_paths
def test_greedy_tokens_are_the_logits_argmax(tiny_folder: Path, native: str) -> None:
    """On the native kernel's argmax or torch's: the same token, the first of equal maxima."""
    model, cache = _ours(tiny_folder, native=native)
    logits = _step(model, cache, [SeqSpan(S(1), start=0, token_ids=[5, 17, 3, 88], num_logits=4)]).clone()
    logits[1] = logits[1].round()  # ties
    assert torch.equal(model.greedy(logits), torch.argmax(logits, dim=-1))
    assert torch.equal(model.greedy(logits[:, 1:]), torch.argmax(logits[:, 1:], dim=-1))  # rows a stride apart
    assert model.greedy(logits[:0]).shape == (0,)
    narrow = logits.to(torch.bfloat16)  # unwidened logits (ModelEngine.forward_with_features(widen_logits=False))
    assert torch.equal(model.greedy(narrow), torch.argmax(narrow.float(), dim=-1))


@ops_paths
def test_ragged_chunked_and_decode_steps_match_reference(tiny_folder: Path, native: str) -> None:
    a = [3, 9, 27, 81, 50, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]  # long: attends alone
    b = [4, 8, 15, 16, 23, 42]
    model, cache = _ours(tiny_folder, native=native)
    ref_a = _reference_logits(tiny_folder, a)
    ref_b = _reference_logits(tiny_folder, b)
    # Step 1: a's first chunk (no logits) together with all of b's prompt but its last token.
    step_one = [SeqSpan(S(0), 0, a[:17], 0), SeqSpan(S(3), 0, b[:4], 1)]
    _step(model, cache, step_one)
    # Step 2: a's second chunk and b's next two tokens in one ragged batch.
    out = _step(model, cache, [SeqSpan(S(0), 17, a[17:19], 2), SeqSpan(S(3), 4, b[4:6], 2)])
    torch.testing.assert_close(out[:2], ref_a[17:19], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[2:], ref_b[4:6], atol=1e-4, rtol=1e-4)
    # Step 3: one-token decodes, slots not adjacent (gathered rows).
    out = _step(model, cache, [SeqSpan(S(3), 6, [99 % 97], 1), SeqSpan(S(0), 19, a[19:], 1)])
    ref_b2 = _reference_logits(tiny_folder, b + [99 % 97])
    torch.testing.assert_close(out[0], ref_b2[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], ref_a[-1], atol=1e-4, rtol=1e-4)


@ops_paths
def test_rewriting_positions_after_truncation(tiny_folder: Path, native: str) -> None:
    """A slot rolled back to position p and written again gives the logits of the new sequence."""
    model, cache = _ours(tiny_folder, native=native)
    _step(model, cache, [SeqSpan(S(1), 0, [1, 2, 3, 4, 5, 6], 0)])
    out = _step(model, cache, [SeqSpan(S(1), 3, [40, 41], 2)])  # overwrite positions 3, 4
    torch.testing.assert_close(out, _reference_logits(tiny_folder, [1, 2, 3, 40, 41])[3:], atol=1e-4, rtol=1e-4)


# A token tree after the prompt's last token: node i's parent is TREE_PARENTS[i] (-1: that last token).
TREE_PARENTS = (-1, 0, 1, -1, 3, 0, 5, 2, -1)


def _branch(parents: tuple[int, ...], tokens: list[int], node: int) -> list[int]:
    """The tokens from the tree's first level down to `node`."""
    path: list[int] = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


@ops_paths
def test_a_token_tree_scores_every_node_as_its_own_branch(tiny_folder: Path, native: str) -> None:
    """Each node of a tree, verified in one step with its siblings and cousins, gets the logits of its branch alone."""
    prompt = [3, 9, 27, 81, 50, 11, 12]
    nodes = [40, 41, 42, 43, 44, 45, 46, 47, 48]
    model, cache = _ours(tiny_folder, native=native)
    _step(model, cache, [SeqSpan(S(1), 0, prompt[:-1], 0)])
    company = [SeqSpan(S(0), 0, [5, 6, 7], 1)]  # another sequence in the step
    out = _step(
        model, cache, [SeqSpan(S(1), len(prompt) - 1, [prompt[-1], *nodes], len(nodes) + 1, TREE_PARENTS), *company]
    )
    torch.testing.assert_close(out[0], _reference_logits(tiny_folder, prompt)[-1], atol=1e-4, rtol=1e-4)
    for node in range(len(nodes)):
        reference = _reference_logits(tiny_folder, prompt + _branch(TREE_PARENTS, nodes, node))[-1]
        torch.testing.assert_close(out[1 + node], reference, atol=1e-4, rtol=1e-4, msg=f"tree node {node}")


def test_a_tree_that_is_one_chain_is_planned_as_a_chain(tiny_folder: Path) -> None:
    model, _ = _ours(tiny_folder, native="native")
    chain = model.plan([SeqSpan(S(1), 4, [1, 2, 3, 4], 4, (-1, 0, 1))], DEFAULT_PAGE_SIZE)
    assert chain.extra is None and chain.cache_positions is None and chain.positions.tolist() == [4, 5, 6, 7]
    tree = model.plan([SeqSpan(S(1), 4, [1, 2, 3, 4], 4, (-1, -1, 1))], DEFAULT_PAGE_SIZE)
    assert tree.positions.tolist() == [4, 5, 5, 6]  # RoPE: each node at its depth
    assert tree.stored_at.tolist() == [4, 5, 6, 7]  # the cache: one after another
    assert tree.attended_to.tolist() == [4, 4, 4, 4]
    assert tree.extra is not None and tree.extra.tolist() == [[-1, -1], [5, -1], [6, -1], [6, 7]]


@pytest.mark.parametrize("parents", [(0,), (-1, 1), (-2,), (-1, 0, 5)])
def test_a_tree_whose_parents_do_not_come_first_is_refused(tiny_folder: Path, parents: tuple[int, ...]) -> None:
    model, _ = _ours(tiny_folder, native="native")
    with pytest.raises(ValueError, match="parent"):
        model.plan([SeqSpan(S(1), 4, [1] * (len(parents) + 1), len(parents) + 1, parents)], DEFAULT_PAGE_SIZE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_native_ops_give_the_logits_of_torch_ops(tiny_folder: Path, dtype: torch.dtype) -> None:
    spans = [SeqSpan(S(0), 0, [5, 17, 3, 88, 42], 2), SeqSpan(S(1), 0, [9, 9], 1)]
    outputs = []
    for native in ("torch", "native"):
        model, _ = _ours(tiny_folder, native=native, dtype=dtype)
        cache = _kv(model.config, 4, dtype)
        outputs.append(_step(model, cache, spans))
    tolerance = {"atol": 0.05, "rtol": 0.02} if dtype == torch.bfloat16 else {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(outputs[1], outputs[0], **tolerance)


def _random_model(dtype: torch.dtype, max_len: int, num_layers: int = 2, **changes: Any) -> DecoderModel:
    """The default model's head shape (head_dim 64, 3 query heads per kv head: the kernels' vectorised path), random
    weights, on the native kernels; `changes` to the config."""
    config = ModelConfig(
        vocab_size=300,
        hidden_size=192,
        intermediate_size=512,
        num_layers=num_layers,
        num_heads=3,
        num_kv_heads=1,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        attention_bias=False,
    )
    config = dataclasses.replace(config, **changes)
    torch.manual_seed(0)
    model = DecoderModel(config, dtype, ops=choose_ops(config, dtype, torch.device("cpu")))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape) * 0.2 if param.dim() > 1 else 1 + 0.1 * torch.randn(param.shape))
    model.set_rope_cache(max_len)
    assert pack_weights(model).startswith("native")
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prompt_gives_the_same_bits_however_it_is_chunked_and_batched(dtype: torch.dtype) -> None:
    """The keys and values a prompt leaves in the cache, and its logits, do not depend on how the scheduler cut it
    into chunks or what else shared its steps: a request's answer does not depend on the server's load."""
    model = _random_model(dtype, 512)
    prompt = [(13 * i + 5) % 300 for i in range(300)]
    company = [SeqSpan(S(2), 0, [7] * 40, 1), SeqSpan(S(3), 0, [8], 1)]
    chunkings = [[300], [1] * 20 + [280], [128, 100, 72], [299, 1]]
    logits, caches = [], []
    for index, chunks in enumerate(chunkings):
        cache = _kv(model.config, 4, dtype)
        start = 0
        for size in chunks:
            span = SeqSpan(S(1), start, prompt[start : start + size], 1)
            out = _step(model, cache, [span, *company] if index % 2 else [span])
            start += size
        logits.append(out[0])
        caches.append((_held(cache.keys, 1, 300).clone(), _held(cache.values, 1, 300).clone()))
    for chunks, row, (keys, values) in zip(chunkings[1:], logits[1:], caches[1:]):
        assert torch.equal(row, logits[0]), f"the logits after chunks {chunks} differ"
        assert torch.equal(keys, caches[0][0]) and torch.equal(values, caches[0][1]), (
            f"the cache after chunks {chunks} differs"
        )


def test_the_engine_reports_whether_its_steps_are_batch_invariant(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from modeling.model.engine import ModelEngine

    config = ModelConfig.from_folder(tiny_folder)
    engine = ModelEngine(
        tiny_folder, config, device="cpu", dtype="float32", num_pages=pages_for_slots(1, 64), max_len=64
    )
    engine.load()
    engine.allocate()
    assert engine.ops.startswith("native") and engine.self_check() is None

    def turned_off() -> None:
        raise KernelUnavailable("turned off for the test")

    monkeypatch.setattr("modeling.kernels.packing.native_ops", turned_off)
    on_torch = ModelEngine(
        tiny_folder, config, device="cpu", dtype="float32", num_pages=pages_for_slots(1, 64), max_len=64
    )
    on_torch.load()
    on_torch.allocate()
    assert on_torch.ops.startswith("torch")
    problem = on_torch.self_check()
    assert problem is not None and "differently from the same row alone" in problem


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("prompt_len", "num_drafts"), [(40, 5), (2000, 16)])
def test_native_verify_rows_equal_the_decode_steps_they_stand_for(
    dtype: torch.dtype, prompt_len: int, num_drafts: int
) -> None:
    """Greedy speculation is lossless only if a verify step's rows are bit for bit the decode steps'.

    A random model with the default model's head shape (head_dim 64, 3 query heads per kv
    head: the kernels' vectorised path) on the native kernels. The second case is a long
    verify span far into the context.
    """
    max_len = 2048
    model = _random_model(dtype, max_len)
    config = model.config
    prompt = [(11 * i) % 300 for i in range(prompt_len)]
    continuation = [(37 * i + 7) % 300 for i in range(num_drafts + 1)]
    decoded, verified = (_kv(config, 4, dtype) for _ in range(2))
    other = [SeqSpan(S(0), 0, [5, 6, 7], 1), SeqSpan(S(2), 0, [8] * 20, 1)]  # company in the step, as in a real batch
    _step(model, decoded, [SeqSpan(S(1), 0, prompt, 1)])
    _step(model, verified, [SeqSpan(S(1), 0, prompt, 1), *other])
    step_rows = [_step(model, decoded, [SeqSpan(S(1), prompt_len + i, [t], 1)])[0] for i, t in enumerate(continuation)]
    verify_rows = _step(
        model, verified, [SeqSpan(S(1), prompt_len, continuation, len(continuation)), SeqSpan(S(0), 3, [9], 1)]
    )
    for i, row in enumerate(step_rows):
        assert torch.equal(row, verify_rows[i]), f"verify row {i} differs from its decode step"

    # A tree's nodes, bit for bit the decode steps of their own branches.
    nodes = [(37 * i + 11) % 300 for i in range(len(TREE_PARENTS))]
    tree_rows = _step(
        model,
        verified,
        [SeqSpan(S(1), prompt_len, [continuation[0], *nodes], len(nodes) + 1, TREE_PARENTS), SeqSpan(S(0), 4, [9], 1)],
    )
    assert torch.equal(tree_rows[0], step_rows[0])
    for node in range(len(nodes)):
        branch = _branch(TREE_PARENTS, nodes, node)
        _step(model, decoded, [SeqSpan(S(1), prompt_len, [continuation[0]], 1)])
        for depth, token in enumerate(branch):
            row = _step(model, decoded, [SeqSpan(S(1), prompt_len + 1 + depth, [token], 1)])[0]
        assert torch.equal(row, tree_rows[1 + node]), f"tree node {node} differs from the decode step of its branch"


def test_the_model_fingerprint_tells_apart_a_model_changed_in_one_tensor_only(
    tiny_llama_folder: Path, tmp_path: Path
) -> None:
    import shutil

    from modeling.model.config import model_fingerprint

    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama_folder, copy)
    assert model_fingerprint(copy) == model_fingerprint(tiny_llama_folder)  # where a model lies does not matter
    (weights,) = copy.glob("*.safetensors")
    # One attention weight of one layer, changed as a merged LoRA would change it (every value, a little).
    header_len = int.from_bytes(weights.read_bytes()[:8], "little")
    header = json.loads(weights.read_bytes()[8 : 8 + header_len])
    start, end = header["model.layers.1.self_attn.o_proj.weight"]["data_offsets"]
    with weights.open("r+b") as f:  # the header stays as it is: only the weight's values change
        f.seek(8 + header_len + start)
        values = torch.frombuffer(bytearray(f.read(end - start)), dtype=torch.float32) + 0.01
        f.seek(8 + header_len + start)
        f.write(values.numpy().tobytes())
    assert model_fingerprint(copy) != model_fingerprint(tiny_llama_folder)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_prefix_read_from_another_sequences_pages_gives_the_bits_of_computing_it(dtype: torch.dtype) -> None:
    """The prefix cache is lossless: a sequence whose block table starts with pages another sequence filled (its
    prompt's shared start) gets the logits, and leaves the keys and values, of one that computed everything itself."""
    model = _random_model(dtype, 512)
    page = DEFAULT_PAGE_SIZE
    shared = [(7 * i + 3) % 300 for i in range(5 * page)]
    first, second = shared + [11, 12, 13], shared + [21, 22, 23, 24]
    cache = KVCache(model.config, 32, page, dtype, torch.device("cpu"))
    first_pages = tuple(range(0, 6))
    _step(model, cache, [SeqSpan(first_pages, 0, first, 1)])
    # The second sequence reads the first's 5 full pages and writes its own sixth.
    reusing = first_pages[:5] + (20,)
    reused = _step(model, cache, [SeqSpan(reusing, 5 * page, second[5 * page :], 4), SeqSpan((30,), 0, [9, 9], 1)])
    computed = _step(model, cache, [SeqSpan(tuple(range(10, 16)), 0, second, 4)])
    assert torch.equal(reused[:4], computed)
    for store in (cache.keys, cache.values):
        assert torch.equal(store[:, 20, :, :4], store[:, 15, :, :4]), "the page written after the shared ones differs"


def test_the_model_fingerprint_does_not_depend_on_how_the_files_spell_the_model(
    tiny_llama_folder: Path, tmp_path: Path
) -> None:
    """The other RoPE spelling, keys in another order, the weights in shards with an index: the same model."""
    from safetensors.torch import load_file, save_file

    from modeling.model.config import model_fingerprint

    respelled = tmp_path / "respelled"
    respelled.mkdir()
    hf = json.loads((tiny_llama_folder / "config.json").read_text())
    theta = hf.pop("rope_parameters")["rope_theta"]
    (respelled / "config.json").write_text(json.dumps(dict(reversed(list({**hf, "rope_theta": theta}.items())))))
    (weights,) = tiny_llama_folder.glob("*.safetensors")
    tensors = load_file(weights)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for shard, members in shards.items():
        save_file({name: tensors[name] for name in members}, str(respelled / shard))
    (respelled / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {}, "weight_map": {name: shard for shard, members in shards.items() for name in members}}
        )
    )
    assert model_fingerprint(respelled) == model_fingerprint(tiny_llama_folder)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "changes",
    [
        {},
        # Qwen2's biases, Mistral-style sliding layers with a RoPE of their own, every projection with a bias
        {
            "attention_bias": True,
            "o_bias": True,
            "mlp_bias": True,
            "sliding_layers": (True, False, True),
            "sliding_window": 7,
            "local_rope_theta": 500.0,
        },
    ],
    ids=["llama", "biases-and-windows"],
)
def test_the_layers_in_one_native_call_give_the_bits_of_the_op_by_op_loop(
    dtype: torch.dtype, changes: dict[str, Any]
) -> None:
    """The native decoder stack (csrc/layers.cpp) runs the ops of the Python loop in its order: every row, prefill,
    decode, verify and tree rows alike, and the cache it leaves are bit for bit the loop's."""
    model = _random_model(dtype, 256, num_layers=3, **changes)
    assert model.fused_layers is not None
    fused = model.fused_layers
    prompt = [(11 * i) % 300 for i in range(40)]
    nodes = [(37 * i + 11) % 300 for i in range(len(TREE_PARENTS))]
    steps = [
        [SeqSpan(S(1), 0, prompt, 1), SeqSpan(S(2), 0, [8] * 20, 20)],  # prefill, one with every row's logits
        [SeqSpan(S(1), 40, [5], 1), SeqSpan(S(2), 20, [6, 7, 9], 3)],  # decode and verify
        [SeqSpan(S(1), 41, [3, *nodes], len(nodes) + 1, TREE_PARENTS), SeqSpan(S(2), 23, [4], 1)],  # a token tree
    ]
    results = []
    for layers in (fused, None):
        model.fused_layers = layers
        cache = _kv(model.config, 4, dtype)
        results.append(([_step(model, cache, spans) for spans in steps], cache))
    (fused_logits, fused_cache), (loop_logits, loop_cache) = results
    for index, (ours, theirs) in enumerate(zip(fused_logits, loop_logits)):
        assert torch.equal(ours, theirs), f"step {index} differs"
    assert torch.equal(fused_cache.keys, loop_cache.keys) and torch.equal(fused_cache.values, loop_cache.values)


def test_one_native_stack_serves_caches_in_turn_as_each_alone() -> None:
    """The stack keeps each layer's views of the cache it was last given: steps on two caches in turn read and write
    the cache each names, as the op-by-op loop does on each alone."""
    model = _random_model(torch.bfloat16, 256, num_layers=3)
    fused = model.fused_layers
    assert fused is not None
    prompts = ([(7 * i) % 300 for i in range(30)], [(13 * i + 5) % 300 for i in range(19)])
    steps = [
        [[SeqSpan(S(1), 0, prompt, 1)], [SeqSpan(S(1), len(prompt), [4 + i], 1)]] for i, prompt in enumerate(prompts)
    ]
    caches = [_kv(model.config, 2, torch.bfloat16) for _ in prompts]
    in_turn: list[list[torch.Tensor]] = [[], []]
    for first, then in [(0, 1), (1, 0)]:  # each step of each cache, the two caches alternating
        for which in (first, then):
            in_turn[which].append(_step(model, caches[which], steps[which][first]))
    model.fused_layers = None
    for which in (0, 1):
        alone = _kv(model.config, 2, torch.bfloat16)
        for index, spans in enumerate(steps[which]):
            assert torch.equal(in_turn[which][index], _step(model, alone, spans)), f"cache {which}, step {index}"
        assert torch.equal(alone.keys, caches[which].keys) and torch.equal(alone.values, caches[which].values)


def test_architectures_the_native_stack_does_not_run_keep_the_op_by_op_loop() -> None:
    assert _random_model(torch.float32, 64, qk_norm=True).fused_layers is None
    assert _random_model(torch.float32, 64, hidden_act="gelu_pytorch_tanh").fused_layers is None


class _Timed:
    """A decoder stack whose calls' start and end times are kept."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.calls = stack, []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return self.stack.forward(*args, **kwargs)
        finally:
            self.calls.append((start, time.monotonic()))


def test_a_long_native_step_lets_other_threads_run() -> None:
    """A worker's heartbeats come from a thread of its own (common/heartbeat_thread.py): the kernels release the
    GIL, so a long step on a loaded machine does not silence them and get the worker declared dead."""
    model = _random_model(
        torch.float32, 1024, num_layers=4, hidden_size=768, intermediate_size=2048, num_heads=12, num_kv_heads=4
    )
    model.fused_layers = _Timed(model.fused_layers)
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.002)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        _step(model, _kv(model.config, 2, torch.float32), [SeqSpan(S(0), 0, [i % 299 + 1 for i in range(900)], 900)])
    finally:
        done.set()
        ticker.join()
    [(start, end)] = model.fused_layers.calls
    during = [t for t in ticks if start < t < end]
    assert end - start > 0.05 and len(during) >= 5, (end - start, len(during))
