"""`specserve up --model FILE.gguf`: a file it cannot convert is refused before anything starts, naming it and why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.stack import free_ports
from tests.gguf_files import FAMILIES


def _up(model: Path, cache: Path) -> subprocess.CompletedProcess[str]:
    grpc_port, http_port = free_ports(2)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "specserve.cli",
            "up",
            "--model",
            str(model),
            "--device",
            "cpu",
            "--port",
            str(grpc_port),
            "--http-port",
            str(http_port),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SPECSERVE_CACHE_DIR": str(cache)},
    )


def _corrupt(path: Path) -> Path:
    data = FAMILIES["qwen2"]().write(path).read_bytes()
    path.write_bytes(data[: len(data) // 3])  # cut inside the tensor data
    return path


def _unknown_architecture(path: Path) -> Path:
    tiny = FAMILIES["qwen2"]()
    tiny.arch = "rwkv7"
    return tiny.write(path)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_corrupt, "not a readable GGUF file"),
        (_unknown_architecture, "general.architecture 'rwkv7' is not supported"),
    ],
)
def test_a_gguf_file_it_cannot_convert_is_refused_before_anything_starts(
    tmp_path: Path, make: object, reason: str
) -> None:
    model = make(tmp_path / "bad.gguf")  # type: ignore[operator]
    done = _up(model, tmp_path / "cache")
    assert done.returncode != 0
    assert f"--model {model}: {reason}" in done.stderr, done.stderr
    assert "READY" not in done.stdout + done.stderr
    assert not list((tmp_path / "cache").glob("gguf/bad-*"))  # nothing half-converted left behind
