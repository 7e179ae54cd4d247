"""The GGUF converter's folder matches what transformers itself makes of the same GGUF file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import load_file
from tokenizers import Tokenizer

from modeling.gguf.convert import convert_gguf, is_converted, unpermute_rope_rows
from modeling.model.store import DEFAULT_MODEL_NAME, default_model_dir, fetch_default_gguf

# Nothing here may reach a model hub; set before transformers (and huggingface_hub) is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
gguf_loader = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "x = 12345\nfor i in range(10):\n    print(i ** 2)  # 3.14159 and 2024-11-30",
    "naïve café 你好 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
    "  leading spaces,\ttabs,\n\n\nand   runs of   spaces ",
]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF file the default model is converted from, fetched afresh."""
    return fetch_default_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(scope="module")
def gguf_tokenizer(gguf_path: Path) -> Any:
    """transformers' own tokenizer for the GGUF file (slow to build, so built once)."""
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def tokenizer_config(default_model_dir: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    return config


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """The row permutation llama.cpp's convert_hf_to_gguf.py applies to q_proj / k_proj."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def transformers_gguf_tensors(gguf_path: Path) -> dict[str, torch.Tensor]:
    """The state dict transformers builds from the GGUF file.

    For llama GGUFs `from_pretrained(..., gguf_file=...)` gets its tensors from exactly this
    call (GgufHfQuantizer.get_state_dict); we call it directly because from_pretrained also
    insists on `accelerate`, which is not a dependency here.
    """
    config = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(config)
    parsed = gguf_loader.load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    return tensors


def test_unpermute_undoes_llama_cpp_permutation() -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((3 * 8, 5)).astype(np.float32)  # 3 heads of head_dim 8
    permuted = llama_cpp_permute(weight, num_heads=3)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rope_rows(permuted, num_heads=3), weight)


def test_weights_equal_transformers_gguf_loading(default_model_dir: Path, gguf_path: Path) -> None:
    ours = load_file(default_model_dir / "model.safetensors")
    theirs = transformers_gguf_tensors(gguf_path)
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name].to(torch.float32)), name


def test_q_and_k_rows_are_reordered(default_model_dir: Path, gguf_path: Path) -> None:
    """Guards the comparison above: the raw GGUF rows differ, so a skipped permutation fails it."""
    raw = {
        t.name: dequantize(t.data, t.tensor_type)
        for t in GGUFReader(gguf_path).tensors
        if t.name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight")
    }
    ours = load_file(default_model_dir / "model.safetensors")
    assert not np.array_equal(ours["model.layers.0.self_attn.q_proj.weight"].numpy(), raw["blk.0.attn_q.weight"])
    assert not np.array_equal(ours["model.layers.0.self_attn.k_proj.weight"].numpy(), raw["blk.0.attn_k.weight"])


def test_config_matches_transformers(default_model_dir: Path, gguf_path: Path) -> None:
    ours = json.loads((default_model_dir / "config.json").read_text())
    theirs = transformers.AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_parameters"] == {"rope_type": "default", "rope_theta": theirs.rope_parameters["rope_theta"]}
    assert ours["architectures"] == ["LlamaForCausalLM"]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(default_model_dir: Path, gguf_tokenizer: Any, text: str) -> None:
    ours = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    ids = ours.encode(text).ids
    assert ids == gguf_tokenizer(text)["input_ids"]
    assert ours.decode(ids, skip_special_tokens=False) == text


def test_control_tokens_are_never_split(default_model_dir: Path) -> None:
    ours = Tokenizer.from_file(str(default_model_dir / "tokenizer.json"))
    assert ours.encode("<|im_start|><|im_end|><|endoftext|>").ids == [1, 2, 0]
    assert ours.decode([1, 4093, 2], skip_special_tokens=True) == "user"


def test_special_tokens_written(default_model_dir: Path, tokenizer_config: dict[str, Any]) -> None:
    generation = json.loads((default_model_dir / "generation_config.json").read_text())
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tokenizer_config["add_bos_token"] is False
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)


def test_chat_template_renders(tokenizer_config: dict[str, Any], gguf_tokenizer: Any) -> None:
    template = jinja2.Environment().from_string(tokenizer_config["chat_template"])
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = template.render(messages=messages, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert rendered == gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_chat_template_keeps_given_system_prompt(tokenizer_config: dict[str, Any]) -> None:
    template = jinja2.Environment().from_string(tokenizer_config["chat_template"])
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    rendered = template.render(messages=messages, add_generation_prompt=False)
    assert rendered == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_default_model_dir_follows_cache_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    assert default_model_dir() == tmp_path / DEFAULT_MODEL_NAME
    assert default_model_dir(tmp_path / "other") == tmp_path / "other" / DEFAULT_MODEL_NAME


def test_default_model_is_marked_complete(default_model_dir: Path) -> None:
    assert is_converted(default_model_dir)
    assert not list(default_model_dir.parent.glob(f".{DEFAULT_MODEL_NAME}.*"))  # no staging leftovers


def test_convert_refuses_existing_folder(gguf_path: Path, tmp_path: Path) -> None:
    with pytest.raises(FileExistsError):
        convert_gguf(gguf_path, tmp_path)
    assert not is_converted(tmp_path)
