"""Fixtures shared by every test tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from modeling.model_store import ensure_default_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model (SmolLM2-135M-Instruct), fetched once into $SPECSERVE_CACHE_DIR."""
    return ensure_default_model()
