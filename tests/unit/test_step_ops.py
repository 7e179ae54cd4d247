"""bench/step_ops.py: a decode step's native ops timed one by one, on the embedded model."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import step_ops
from modeling.kernels.native import KernelUnavailable, native_ops


def test_every_op_of_the_layer_loop_is_timed_and_the_linears_are_told_apart(
    default_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        native_ops()
    except KernelUnavailable as why:
        pytest.skip(f"no native kernels: {why}")
    assert (
        step_ops.main(
            [
                "--model",
                str(default_model_dir),
                "--dtype",
                "float32",
                "--quantization",
                "none",
                "--batch",
                "2",
                "--repeats",
                "2",
                "--context",
                "8",
                "--threads",
                "1",
            ]
        )
        == 0
    )
    rows = {
        line.split("|")[1].strip(): line.split("|")[2].strip()
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and not line.startswith("| op ")
    }
    layers = "30"  # SmolLM2-135M
    assert rows == {
        "attend": layers,
        "store": layers,
        "rope_": layers,
        "silu_mul": layers,
        "add_rms_norm_": "60",
        "rms_norm": "1",
        "linear to 960": layers,
        "linear to 576": "60",
        "linear to 3072": layers,
        "linear to 49152": "1",
    }
