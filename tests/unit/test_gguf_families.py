"""Every GGUF architecture the converter knows, as a tiny file: the folder it makes equals what transformers makes of
the same file (config, tensors, logits, tokenizer), and what it cannot represent is refused by name."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file
from tokenizers import Tokenizer

from modeling.gguf.convert import GgufConversionError, convert_gguf
from modeling.gguf.rope import llama3_divisors, llama3_rope_scaling
from common.text.tokenizer import ChatMessage
from common.text.tokenizer import Tokenizer as ServingTokenizer
from tests.gguf_files import FAMILIES, TEXTS, Shape, TinyGguf, byte_level_vocabulary, comparable

# Nothing here may reach a model hub; set before transformers (and huggingface_hub) is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
gguf_loader = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
rope_utils = pytest.importorskip("transformers.modeling_rope_utils")


@dataclass
class Converted:
    gguf: Path
    folder: Path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def converted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Converted:
    root = tmp_path_factory.mktemp(f"tiny-{request.param}")
    gguf_path = FAMILIES[request.param]().write(root / "model.gguf")
    return Converted(gguf_path, convert_gguf(gguf_path, root / "converted"))


def transformers_gguf_load(gguf_path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """transformers' config and state dict for the file, as `from_pretrained(..., gguf_file=...)` builds them.

    For these architectures from_pretrained gets its tensors from exactly this call (GgufHfQuantizer.get_state_dict);
    we call it directly because from_pretrained also insists on `accelerate`, which is not a dependency here.
    """
    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    parsed = gguf_loader.load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    return config, parsed["tensors"]


def test_config_equals_transformers_gguf_config(converted: Converted) -> None:
    ours = transformers.AutoConfig.from_pretrained(converted.folder)
    theirs, _ = transformers_gguf_load(converted.gguf)
    assert comparable(ours) == comparable(theirs)
    written = json.loads((converted.folder / "config.json").read_text())
    assert written["architectures"] == [type(transformers.AutoModelForCausalLM.from_config(ours)).__name__]


def test_config_is_spelled_as_transformers_writes_it(converted: Converted) -> None:
    written = json.loads((converted.folder / "config.json").read_text())
    rewritten = transformers.AutoConfig.for_model(**written).to_dict()
    assert {key: rewritten.get(key, "<dropped>") for key in written} == written


def test_tensors_equal_transformers_gguf_tensors(converted: Converted) -> None:
    ours = load_file(converted.folder / "model.safetensors")
    _, theirs = transformers_gguf_load(converted.gguf)
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name].to(torch.float32)), name


def test_logits_equal_transformers_gguf_model(converted: Converted) -> None:
    ours = transformers.AutoModelForCausalLM.from_pretrained(converted.folder).eval()
    config, tensors = transformers_gguf_load(converted.gguf)
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = theirs.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the head is the embedding
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, rtol=1e-5, atol=1e-5)


def test_tokenizer_equals_transformers_gguf_tokenizer(converted: Converted) -> None:
    ours = Tokenizer.from_file(str(converted.folder / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(converted.gguf.parent, gguf_file=converted.gguf.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text


# ---------------------------------------------------------------- what the families add


def test_gemma3_norms_are_stored_without_llama_cpps_plus_one(tmp_path: Path) -> None:
    tiny = FAMILIES["gemma3"]()
    folder = convert_gguf(tiny.write(tmp_path / "g.gguf"), tmp_path / "out")
    stored = dict((name, weight) for name, weight, _ in tiny.tensors)
    ours = load_file(folder / "model.safetensors")
    for gguf_name, hf_name in (
        ("blk.0.post_ffw_norm.weight", "model.layers.0.post_feedforward_layernorm.weight"),
        ("blk.1.attn_k_norm.weight", "model.layers.1.self_attn.k_norm.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ):
        np.testing.assert_array_equal(ours[hf_name].numpy(), stored[gguf_name] - np.float32(1.0))


def test_gemma3_config_and_generation_config(tmp_path: Path) -> None:
    folder = convert_gguf(FAMILIES["gemma3"]().write(tmp_path / "g.gguf"), tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert (config["hidden_activation"], config["query_pre_attn_scalar"], config["sliding_window"]) == (
        "gelu_pytorch_tanh",
        256,
        512,
    )
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 5]  # <eos>, then <end_of_turn>
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())


def test_gemma3_runs_of_spaces_longer_than_any_token_are_cut_longest_first(tmp_path: Path) -> None:
    """As SentencePiece matches its user-defined pieces, and llama.cpp its user-defined tokens. transformers' GGUF
    tokenizer differs here: it merges the run as BPE merges pairs, 4 + 6 spaces where this gives 8 + 2.
    (The real Gemma 3 vocabulary has runs of up to 31 spaces, so there the two differ from 32 spaces on.)"""
    folder = convert_gguf(FAMILIES["gemma3"]().write(tmp_path / "g.gguf"), tmp_path / "out")
    ours = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert ours.encode("a" + " " * 10 + "b").tokens == ["<bos>", "a", " " * 8, " " * 2, "b"]
    assert ours.encode("a" + " " * 9 + "b").tokens == ["<bos>", "a", " " * 8, "▁b"]


def test_mistral_style_llama_with_a_sliding_window(tmp_path: Path) -> None:
    tiny = FAMILIES["llama-spm"]()
    tiny.metadata["llama.attention.sliding_window"] = 4096
    folder = convert_gguf(tiny.write(tmp_path / "m.gguf"), tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["architectures"], config["sliding_window"]) == (
        "mistral",
        ["MistralForCausalLM"],
        4096,
    )
    assert transformers.AutoConfig.for_model(**config).sliding_window == 4096


@pytest.mark.parametrize(
    ("gguf_scaling", "expected"),
    [
        ({"type": "linear", "factor": 4.0}, {"rope_type": "linear", "factor": 4.0}),
        (
            {"type": "yarn", "factor": 4.0, "original_context_length": 1024},
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        ),
    ],
)
def test_rope_scaling_metadata(tmp_path: Path, gguf_scaling: dict[str, Any], expected: dict[str, Any]) -> None:
    tiny = FAMILIES["qwen2"]()
    tiny.metadata.update({f"qwen2.rope.scaling.{key}": value for key, value in gguf_scaling.items()})
    folder = convert_gguf(tiny.write(tmp_path / "q.gguf"), tmp_path / "out")
    rope = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert rope == {"rope_theta": 1000000.0, **expected}


LLAMA3_SCALINGS = [
    {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    {"factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 2.5, "original_max_position_embeddings": 4096},
]


def llama_cpp_rope_freqs(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """rope_freqs.weight as llama.cpp's converter computes it for a Llama 3.1-style model: float32 throughout."""
    frequencies = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    return llama3_divisors(scaling, (2 * math.pi / frequencies).numpy()).astype(np.float32)


@pytest.mark.parametrize("scaling", LLAMA3_SCALINGS)
def test_llama3_scaling_is_recovered_from_rope_freqs(scaling: dict[str, Any]) -> None:
    divisors = llama_cpp_rope_freqs(scaling, 500000.0, 128)
    recovered = llama3_rope_scaling(divisors, 500000.0, 128, tensor_name="rope_freqs.weight")
    assert recovered is not None
    assert recovered == {"rope_type": "llama3", **scaling}
    # ... and transformers' own llama3 RoPE with it divides each plain frequency by the file's divisor.
    config = transformers.LlamaConfig(
        hidden_size=128 * 4,
        num_attention_heads=4,
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **recovered},
    )
    inv_freq, _ = rope_utils.ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    torch.testing.assert_close(inv_freq.double(), plain / torch.from_numpy(divisors).double(), rtol=1e-6, atol=0)


def test_rope_freqs_become_rope_parameters(tmp_path: Path) -> None:
    tiny = TinyGguf(
        "llama",
        Shape(hidden_size=128, num_heads=2, num_kv_heads=1, head_dim=64),
        byte_level_vocabulary("llama-bpe", add_bos=True),
    )
    tiny.add("rope_freqs.weight", llama_cpp_rope_freqs(LLAMA3_SCALINGS[2], 500000.0, 64).reshape(1, -1)[0])
    folder = convert_gguf(tiny.write(tmp_path / "l.gguf"), tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"] == {"rope_theta": 500000.0, "rope_type": "llama3", **LLAMA3_SCALINGS[2]}
    assert "rope_freqs.weight" not in load_file(folder / "model.safetensors")


def test_rope_freqs_no_llama3_scaling_reproduces_are_refused(tmp_path: Path) -> None:
    divisors = np.random.default_rng(0).uniform(1.0, 8.0, 32).astype(np.float32)
    with pytest.raises(GgufConversionError, match="rope_freqs.weight"):
        llama3_rope_scaling(divisors, 500000.0, 64, tensor_name="rope_freqs.weight")


def test_chat_templates_and_end_of_generation_tokens(tmp_path: Path) -> None:
    tiny = FAMILIES["qwen2"]()
    tiny.metadata.update(
        {"tokenizer.chat_template": "{{ messages[0]['content'] }}", "tokenizer.chat_template.tool_use": "{{ tools }}"}
    )
    tiny.vocabulary.fields["eot_token_id"] = 1
    folder = convert_gguf(tiny.write(tmp_path / "q.gguf"), tmp_path / "out")
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == [
        {"name": "default", "template": "{{ messages[0]['content'] }}"},
        {"name": "tool_use", "template": "{{ tools }}"},
    ]
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [2, 1]  # EOS, then EOT
    tokenizer = ServingTokenizer.load(folder)
    assert tokenizer.eos_token_ids == (2, 1)
    assert tokenizer.render_chat([ChatMessage("user", "hi")]) == "hi"


# ---------------------------------------------------------------- refusals


def test_an_unknown_architecture_is_refused_naming_it(tmp_path: Path) -> None:
    tiny = FAMILIES["llama"]()
    tiny.arch = "bloom"
    with pytest.raises(GgufConversionError, match="general.architecture 'bloom' is not supported") as refused:
        convert_gguf(tiny.write(tmp_path / "b.gguf"), tmp_path / "out")
    assert "b.gguf" in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_an_unmapped_metadata_key_is_refused_naming_it(tmp_path: Path) -> None:
    tiny = FAMILIES["qwen3"]()
    tiny.metadata["qwen3.attention.clamp_kqv"] = 8.0
    with pytest.raises(GgufConversionError, match="'qwen3.attention.clamp_kqv' is not understood"):
        convert_gguf(tiny.write(tmp_path / "q.gguf"), tmp_path / "out")


def test_an_unmapped_tensor_is_refused_naming_it(tmp_path: Path) -> None:
    tiny = FAMILIES["qwen3"]()
    tiny.add("blk.0.attn_output.bias", np.zeros(64, np.float32))
    with pytest.raises(GgufConversionError, match="'blk.0.attn_output.bias' has no counterpart in a qwen3 model"):
        convert_gguf(tiny.write(tmp_path / "q.gguf"), tmp_path / "out")


def test_a_type_gguf_cannot_dequantize_is_refused_naming_tensor_and_type(tmp_path: Path) -> None:
    tiny = FAMILIES["qwen2"]()
    tiny.tensors = [
        (name, weight.astype(np.float64), GGMLQuantizationType.F64)
        if name == "blk.1.ffn_up.weight"
        else (name, weight, kind)
        for name, weight, kind in tiny.tensors
    ]
    with pytest.raises(GgufConversionError, match="'blk.1.ffn_up.weight' is of type F64"):
        convert_gguf(tiny.write(tmp_path / "q.gguf"), tmp_path / "out")


@pytest.mark.parametrize("damage", ["truncated", "not_gguf"])
def test_a_damaged_file_is_refused_naming_it(tmp_path: Path, damage: str) -> None:
    path = FAMILIES["qwen2"]().write(tmp_path / "damaged.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a gguf file" + data[16:])
    with pytest.raises(GgufConversionError, match="damaged.gguf: not a readable GGUF file"):
        convert_gguf(path, tmp_path / "out")
    assert not list(tmp_path.glob(".out*")) and not (tmp_path / "out").exists()


def test_malformed_metadata_is_refused_naming_the_file(tmp_path: Path) -> None:
    tiny = FAMILIES["qwen2"]()
    tiny.vocabulary.fields["bos_token_id"] = 10**6  # past the vocabulary
    with pytest.raises(GgufConversionError, match="q.gguf: malformed metadata"):
        convert_gguf(tiny.write(tmp_path / "q.gguf"), tmp_path / "out")
