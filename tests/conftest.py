"""Fixtures shared by every test tier."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from modeling.model_store import ensure_default_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model (SmolLM2-135M-Instruct), fetched once into $SPECSERVE_CACHE_DIR."""
    return ensure_default_model()


@pytest.fixture(scope="session")
def tiny_llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny randomly initialised Llama (vocabulary 97, 3 layers) saved as a Hugging Face folder."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(hf_config)
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder)
    return folder
