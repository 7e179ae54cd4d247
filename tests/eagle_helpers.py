"""A small untrained EAGLE-style head for a tiny target, shared by the unit and process tests."""

from __future__ import annotations

from pathlib import Path

import torch

from modeling.model.config import ModelConfig
from modeling.model.eagle import EagleHead
from modeling.model.checkpoint import read_safetensors


def tiny_head(target: Path) -> EagleHead:
    """A head over the even token ids, started from the target's last layer, its mixing weights random.

    Its parameters are rounded to bf16, as a saved folder holds them, so the saved and the
    in-memory head compute the same.
    """
    config = ModelConfig.from_folder(target)
    tensors = read_safetensors(target)
    head = EagleHead(config, tensors["model.embed_tokens.weight"], torch.arange(0, config.vocab_size, 2))
    head.init_layer_from(tensors, config.num_layers - 1, tensors["model.norm.weight"])
    with torch.no_grad():
        head.fc.normal_(std=0.2, generator=torch.Generator().manual_seed(1))
        for p in head.parameters():
            p.copy_(p.bfloat16().float())
    return head
