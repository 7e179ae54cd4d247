"""Target features (final hidden states) to and from their wire form, `proto.messages.FeatureRows`."""

from __future__ import annotations

import torch

from proto.messages import FeatureRows

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class FeatureError(ValueError):
    """Feature rows whose bytes do not match their stated shape and dtype."""


def to_rows(features: torch.Tensor, start_position: int) -> FeatureRows:
    """`[n, width]` -> rows for positions start_position .. start_position+n-1."""
    rows = features.detach().contiguous().cpu()
    name = str(rows.dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise FeatureError(f"features of dtype {name} cannot be sent")
    return FeatureRows(start_position, rows.shape[0], rows.shape[1], name, rows.view(torch.uint8).numpy().tobytes())


def from_rows(rows: FeatureRows) -> torch.Tensor:
    """-> `[num_rows, width]` of the rows' dtype; raises FeatureError when the bytes do not fit."""
    dtype = _DTYPES.get(rows.dtype)
    if dtype is None:
        raise FeatureError(f"unknown feature dtype {rows.dtype!r}")
    if rows.num_rows < 0 or rows.width <= 0:
        raise FeatureError(f"feature rows of shape ({rows.num_rows}, {rows.width})")
    expected = rows.num_rows * rows.width * dtype.itemsize
    if len(rows.data) != expected:
        raise FeatureError(
            f"{len(rows.data)} bytes of features, ({rows.num_rows}, {rows.width}) {rows.dtype} needs {expected}"
        )
    if expected == 0:
        return torch.empty(0, rows.width, dtype=dtype)
    return torch.frombuffer(bytearray(rows.data), dtype=dtype).view(rows.num_rows, rows.width)
