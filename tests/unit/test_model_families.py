"""Every supported family and RoPE option against transformers' own implementation, on tiny random models.

Each case builds a model with transformers (a few layers, small widths, random weights
scaled up so that every part of the math shows in the logits), saves it as a folder, and
loads that folder into our engine: logits within float32 tolerance of transformers' for a
prompt longer than any sliding window, prefilled at once and then decoded token by token
(on the native kernels and on torch ops), and greedy output identical to transformers'.
Both config spellings (transformers 5's `rope_parameters`, the older top-level `rope_theta`
and `rope_scaling`) must give the same configuration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig
from modeling.kernels.packing import choose_ops, pack_weights
from modeling.model.engine import ModelEngine
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE, KVCache, pages_for
from modeling.model.decoder import TORCH_OPS, DecoderModel

transformers = pytest.importorskip("transformers")

VOCAB = 256
PROMPT = [(37 * i + 11) % VOCAB for i in range(45)]  # longer than every window below
PROMPTS = [PROMPT[:7], [5, 5, 5, 9, 200, 17], PROMPT[3:40]]
NUM_NEW = 12
MAX_LEN = 128

_SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (transformers config class, its settings)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-plain": ("LlamaConfig", {"rope_theta": 500000.0}),
    "llama-llama3": ("LlamaConfig", {"rope_parameters": {"rope_theta": 500000.0, **LLAMA3}}),
    "llama-linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
    "llama-dynamic": (
        "LlamaConfig",
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}},
    ),
    "llama-yarn": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "llama-yarn-mscale": (
        "LlamaConfig",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "original_max_position_embeddings": 32,
                "mscale": 1.0,
                "mscale_all_dim": 0.5,
                "beta_fast": 16.0,
                "beta_slow": 2.0,
                "truncate": False,
            }
        },
    ),
    "llama-biases": ("LlamaConfig", {"attention_bias": True, "mlp_bias": True, "head_dim": 24}),
    "mistral-window": ("MistralConfig", {"sliding_window": 9}),
    "mistral-no-window": ("MistralConfig", {"sliding_window": None, "head_dim": 32}),
    "qwen2": ("Qwen2Config", {"rope_theta": 1000000.0, "tie_word_embeddings": False}),
    "qwen2-window": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1}),
    "qwen3": ("Qwen3Config", {"head_dim": 16, "rope_parameters": {"rope_theta": 1000000.0, **LLAMA3}}),
    "qwen3-window": (
        "Qwen3Config",
        {
            "head_dim": 32,
            "attention_bias": True,
            "use_sliding_window": True,
            "sliding_window": 10,
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
        },
    ),
    "gemma3": (
        "Gemma3TextConfig",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    ),
    "gemma3-scaled": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": 11,
            "num_hidden_layers": 4,
            "rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        },
    ),
}


def make_model(name: str, folder: Path) -> Any:
    """The case's transformers model, saved in `folder` (its norms and biases randomised too)."""
    kind, settings = CASES[name]
    config = getattr(transformers, kind)(**{**_SHAPE, **settings})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() == 1:  # norms (around 1, or 0 for Gemma's w - 1 convention) and biases
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Any]:
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, make_model(request.param, folder)


def _ours(folder: Path, native: bool) -> tuple[DecoderModel, KVCache]:
    config = ModelConfig.from_folder(folder)
    model = DecoderModel(config, ops=choose_ops(config, torch.float32, torch.device("cpu")) if native else TORCH_OPS)
    model.load_weights(folder)
    model.set_rope_cache(MAX_LEN)
    if native:
        assert pack_weights(model).startswith("native")
    pages = pages_for(MAX_LEN, DEFAULT_PAGE_SIZE)
    return model, KVCache(config, pages, DEFAULT_PAGE_SIZE, torch.float32, torch.device("cpu"))


def _logits(model: DecoderModel, cache: KVCache, spans: list[SeqSpan]) -> torch.Tensor:
    with torch.inference_mode():
        batch = model.plan(spans, DEFAULT_PAGE_SIZE)
        return model.logits(model(batch, cache)[batch.logit_rows])


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
def test_logits_match_transformers_prefilled_and_decoded(case: tuple[str, Path, Any], native: bool) -> None:
    name, folder, reference = case
    with torch.inference_mode():
        expected = reference(torch.tensor([PROMPT])).logits[0]  # [T, V]
    model, cache = _ours(folder, native)
    pages = tuple(range(cache.num_pages))
    split = 20
    prefilled = _logits(model, cache, [SeqSpan(pages, 0, PROMPT[:split], split)])
    decoded = torch.cat([_logits(model, cache, [SeqSpan(pages, p, [PROMPT[p]], 1)]) for p in range(split, len(PROMPT))])
    torch.testing.assert_close(prefilled, expected[:split], atol=2e-4, rtol=1e-4, msg=f"{name}: prefill")
    torch.testing.assert_close(decoded, expected[split:], atol=2e-4, rtol=1e-4, msg=f"{name}: decode past the window")
    # The case is not vacuous: the logits spread well beyond the tolerance.
    assert float(expected.std()) > 0.05


def _reference_greedy(reference: Any, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens (its forward pass over the whole sequence each step: no generation-time logits
    processors, which would suppress the EOS id of some configs), cut after the first step whose top two logits nearly
    tie."""
    sequence = list(prompt)
    with torch.inference_mode():
        for _ in range(NUM_NEW):
            scores = reference(torch.tensor([sequence])).logits[0, -1]
            sequence.append(int(scores.argmax()))
            top = torch.topk(scores.float(), 2).values
            if float(top[0] - top[1]) < 1e-3:
                break
    return sequence[len(prompt) :]


def test_greedy_output_through_the_engine_matches_transformers(case: tuple[str, Path, Any]) -> None:
    name, folder, reference = case
    engine = ModelEngine(
        folder,
        ModelConfig.from_folder(folder),
        device="cpu",
        dtype="float32",
        num_pages=pages_for(MAX_LEN, DEFAULT_PAGE_SIZE),
        max_len=MAX_LEN,
    )
    engine.load()
    engine.allocate()
    engine.self_check()  # the start-up check a worker runs: raises when prefill and decode disagree
    compared = 0
    for prompt in PROMPTS:
        expected = _reference_greedy(reference, prompt)
        pages = engine.slot_pages(0)
        logits = engine.forward([SeqSpan(pages, 0, prompt, 1)])
        ours = [int(logits[-1].argmax())]
        while len(ours) < len(expected):
            logits = engine.forward([SeqSpan(pages, len(prompt) + len(ours) - 1, [ours[-1]], 1)])
            ours.append(int(logits[-1].argmax()))
        assert ours == expected, f"{name}: prompt {prompt[:4]}..."
        compared += len(expected)
    assert compared >= NUM_NEW


def test_a_draft_model_of_the_family_proposes_what_the_model_would_say(case: tuple[str, Path, Any]) -> None:
    """The draft service's model draft runs every family: the model drafting for itself proposes its greedy tokens."""
    from draft_service.model_proposer import ModelProposer
    from draft_service.proposer import ProposeInput
    from proto.messages import SamplingParams

    name, folder, reference = case
    proposer = ModelProposer(
        folder, device="cpu", dtype="float32", num_seqs=2, max_len=MAX_LEN, max_draft_tokens=4, draft_top_k=8
    )
    for phase in proposer.phases():
        phase()
    prompt = PROMPT[:30]  # past the shortest sliding window
    expected = _reference_greedy(reference, prompt)[:4]
    (made,) = proposer.propose([ProposeInput("a", prompt, 0, 4, SamplingParams(temperature=0.0))])
    assert made.token_ids[: len(expected)] == expected, name


def _old_spelling(hf: dict[str, Any]) -> dict[str, Any]:
    """The config as transformers 4 wrote it:
    a top-level rope_theta (and Gemma's rope_local_base_freq), rope_scaling."""
    old = dict(hf)
    parameters = old.pop("rope_parameters")
    if "full_attention" in parameters:
        old["rope_local_base_freq"] = parameters["sliding_attention"]["rope_theta"]
        parameters = parameters["full_attention"]
    parameters = dict(parameters)
    old["rope_theta"] = parameters.pop("rope_theta")
    kind = parameters.get("rope_type", "default")
    old["rope_scaling"] = None if kind == "default" else {"type": parameters.pop("rope_type"), **parameters}
    return old


def test_both_config_spellings_give_the_same_model(case: tuple[str, Path, Any]) -> None:
    name, folder, _ = case
    hf = json.loads((folder / "config.json").read_text())
    assert "rope_parameters" in hf  # what transformers 5 writes
    old = _old_spelling(hf)
    assert "rope_parameters" not in old and "rope_theta" in old
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(hf), name


@pytest.fixture(scope="module")
def sharded_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama of ~45M parameters (~180 MB in float32), saved by transformers in shards with their index."""
    folder = tmp_path_factory.mktemp("sharded-llama")
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="50MB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    return folder


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_loading_a_sharded_model_holds_little_more_than_its_weights(sharded_llama: Path, dtype: str) -> None:
    """Peak host memory of ModelEngine.load() (read, then packed for the native kernels), in a fresh process."""
    from bench.load_memory import measure

    m = measure(sharded_llama, dtype, "engine")
    assert m.peak_bytes - m.baseline_bytes <= 1.2 * m.weights_bytes + (32 << 20), m


def test_loading_the_default_model_in_bfloat16_holds_little_more_than_its_weights(default_model_dir: Path) -> None:
    from bench.load_memory import measure

    m = measure(default_model_dir, "bfloat16", "engine")
    assert m.peak_bytes - m.baseline_bytes <= 1.2 * m.weights_bytes + (32 << 20), m
