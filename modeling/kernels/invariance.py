"""Batch invariance: whether every row of a step is computed exactly as it would be alone, whatever the step holds.

Greedy speculation is lossless only if a verify step's rows are, bit for bit, the decode
steps they stand for, and a request gives the same answer at any concurrency only if its
rows do not depend on the other rows of its steps. Library matmuls do not promise that
(they choose their blocking, and so their order of summation, by the number of rows);
the native kernels are written to (modeling/kernels/csrc). An engine checks it on start-up: its
linear layers over every tile shape a step can use, then the whole model (see
`ModelEngine.self_check`). A worker whose check fails serves without speculation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

# Every count up to 64 (each tile shape and remainder of the kernels), then larger steps.
PROBE_ROW_COUNTS = (*range(1, 65), 97, 128, 255, 513)
# Output columns of each probe weight: several panels of any kernel, and a partial one.
PROBE_OUT_FEATURES = 3 * 64 + 5

Linear = Callable[..., torch.Tensor]


def linear_rows_problem(
    linear: Linear,
    pack: Callable[[torch.Tensor], torch.Tensor],
    depths: Iterable[int],
    dtype: torch.dtype,
    device: torch.device,
) -> str | None:
    """None if, for each input width in `depths`, every row of a call on 1 .. 513 rows equals that row alone.

    `pack` turns a plain `[N, K]` weight into what `linear` takes. The rows have different
    magnitudes, as activations have; the weight is random, since only the kernel's order
    of summation is under test.
    """
    generator = torch.Generator().manual_seed(0)
    num_rows = max(PROBE_ROW_COUNTS)
    for depth in sorted(set(depths)):
        weight = pack(
            (torch.randn(PROBE_OUT_FEATURES, depth, generator=generator) * 0.05).to(device=device, dtype=dtype)
        )
        scale = torch.rand(num_rows, 1, generator=generator) * 3
        rows = (torch.randn(num_rows, depth, generator=generator) * scale).to(device=device, dtype=dtype)
        with torch.inference_mode():
            alone = torch.cat([linear(rows[r : r + 1].clone(), weight) for r in range(num_rows)])
            for count in PROBE_ROW_COUNTS:
                together = linear(rows[:count].clone(), weight)
                differ = (together != alone[:count]).any(dim=-1).nonzero().flatten().tolist()
                if differ:
                    return (
                        f"a linear layer of input width {depth} computes row {differ[0]} of a {count}-row step "
                        f"differently from the same row alone ({len(differ)} of {count} rows differ)"
                    )
    return None
