"""bench/linear_kernel.py --layers: a decode step's projections, each layer its own weights, timed as passes."""

from __future__ import annotations

import pytest

from bench import linear_kernel
from modeling.kernels.native import KernelUnavailable, native_ops


@pytest.mark.parametrize("blocks", [[], ["--blocks", "q4_1"]])
def test_layer_passes_report_each_row_count_with_the_weights_bytes(
    blocks: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        native_ops()
    except KernelUnavailable as why:
        pytest.skip(f"no native kernels: {why}")
    assert (
        linear_kernel.main(
            [*blocks, "--dtype", "bfloat16", "--rows", "1", "3", "--layers", "2", "--repeats", "2", "--threads", "1"]
        )
        == 0
    )
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| bfloat16")]
    assert [(cells[2].strip(), cells[3].strip()) for cells in rows] == [("2", "1"), ("2", "3")]
    weights = 2 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536)  # two layers' projections
    # bfloat16: 2 bytes a weight (panels of 16 outputs, none padded here); Q4_1: 20 bytes a block of 32
    expected = weights * 20 / 32 if blocks else weights * 2
    assert all(float(cells[5]) == pytest.approx(expected / 1e6, abs=0.05) for cells in rows)
    assert all(float(cells[4]) > 0 and float(cells[6]) > 0 for cells in rows)
