"""Prepacked oneDNN weights for the linear layers on CPU: the same products, faster matrix-vector kernels.

Applied to a built model (the model file stays plain): each projection weight is
reordered once into oneDNN's blocked layout, and the model's `linear` becomes oneDNN's
linear on those weights. Measured here in bfloat16 it cuts a batch-1 decode's matmul
time by ~30%, with bit-identical outputs. In float32 it replaces MKL, whose products of
2 to 7 rows (a verify step) take 2-3x as long as one row; oneDNN's take about as long.
"""

from __future__ import annotations

import torch

from modeling.native import KernelUnavailable, native_ops
from modeling.llama import LlamaModel

# The batch size oneDNN tunes the packed layout for; the packed weights serve every size
# (and one row runs as two where needed, see OneDnnLinear).
_PACK_BATCH_HINT = 2


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 or fp32 on a CPU whose torch build has oneDNN and these (private) ops; else the plain path is used."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32) or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 - probing for the op
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def attach_native_ops(model: LlamaModel, dtype: torch.dtype, device: torch.device) -> str:
    """Give a CPU float32 or bfloat16 model the native kernels (modeling/native.py).

    Returns which ops the model runs on, and why, for the owner's log.
    """
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return f"torch (no native ops for {dtype} on {device.type})"
    try:
        model.native = native_ops()
    except KernelUnavailable as exc:
        return f"torch ({exc})"
    return "native"


def prepack_linears(model: LlamaModel) -> None:
    """Reorder every projection weight (and a separate LM-head copy) into oneDNN's layout."""
    with torch.no_grad():
        for layer in model.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                setattr(layer, name, prepack_weight(getattr(layer, name)))
        # The embedding lookup needs the plain table, so the LM head gets its own packed copy.
        model.lm_head = prepack_weight(model.lm_head)
        weights = [model.lm_head, *(getattr(layer, name) for layer in model.layers
                                    for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))]
        shapes = {tuple(w.shape): w for w in weights}
        model.linear = OneDnnLinear({shape for shape, w in shapes.items() if not _one_row_matches_many(w)})


def prepack_weight(weight: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT), requires_grad=False)


class OneDnnLinear:
    """y = x @ W^T (+ b) on prepacked weights, each row computed the same way whatever the number of rows.

    oneDNN runs a single row through a matrix-vector kernel. For some weight shapes (here
    576 x 1536: long rows) it sums in another order than the matrix kernel, and so rounds
    some outputs differently: a verify step's rows would then differ from the
    plain decode steps they stand for, and greedy speculation would not be lossless. For
    those shapes one row runs as two. Which shapes they are is measured when the weights
    are packed (`_one_row_matches_many`), since it depends on the oneDNN build and the CPU.
    """

    def __init__(self, two_row_shapes: set[tuple[int, ...]]) -> None:
        self.two_row_shapes = frozenset(two_row_shapes)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 1 and tuple(weight.shape) in self.two_row_shapes:
            doubled = _linear(x.expand(2, -1).contiguous(), weight, bias)
            return doubled[:1]
        return _linear(x, weight, bias)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out


def _one_row_matches_many(weight: torch.Tensor, num_rows: int = 64) -> bool:
    """Whether each of `num_rows` random rows alone gives bit for bit what it gives among all of them."""
    generator = torch.Generator().manual_seed(0)
    scale = torch.rand(num_rows, 1, generator=generator) * 3  # rows of different magnitudes, as activations are
    rows = (torch.randn(num_rows, weight.shape[1], generator=generator) * scale).to(weight.dtype)
    together = _linear(rows, weight, None)
    return all(torch.equal(_linear(rows[r : r + 1].clone(), weight, None)[0], together[r]) for r in range(num_rows))
