"""What the draft head learns from: a padded batch, its losses (feature regression and next-token), and the figures."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distill.data import Sequence
from modeling.model.eagle import EagleHead


def pad_batch(batch: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> input features `[B, T, H]` (f_0..f_{T-1}), next tokens `[B, T]` (x_1..x_T),
    target features (f_1..f_T), mask `[B, T]`."""
    t = max(len(s.tokens) - 2 for s in batch)
    h = batch[0].features.shape[1]
    feats = torch.zeros(len(batch), t, h)
    targets = torch.zeros(len(batch), t, h)
    tokens = torch.zeros(len(batch), t, dtype=torch.long)
    mask = torch.zeros(len(batch), t, dtype=torch.bool)
    for i, s in enumerate(batch):
        n = len(s.tokens) - 2  # pairs (f_j, x_{j+1}) whose next feature f_{j+1} is known
        if n <= 0:
            continue
        f = s.features.float()
        feats[i, :n] = f[:n]
        targets[i, :n] = f[1 : n + 1]
        tokens[i, :n] = torch.tensor(s.tokens[1 : n + 1])
        mask[i, :n] = True
    return feats, tokens, targets, mask


def head_losses(
    head: EagleHead, batch: list[Sequence], noise: float, unroll: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Feature regression, next-token cross-entropy and top-1 agreement (of the first step),
    averaged over `unroll` steps.

    Step 1 reads the target's features; step d reads, at every position j > 0, what
    step d-1 predicted for f_j: the input a chained draft token sees.
    """
    feats, tokens, targets, mask = pad_batch(batch)
    if noise > 0 and head.training:  # drawn on the CPU whatever the device: one random stream, the same resumed
        scale = feats.pow(2).mean(-1, keepdim=True).sqrt()
        feats = feats + torch.randn_like(feats) * scale * noise
    device = head.fc.device
    feats, tokens, targets, mask = feats.to(device), tokens.to(device), targets.to(device), mask.to(device)
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        teacher = head.draft_logits(targets).float()[mask]
    p = teacher.softmax(-1)
    regs, clss = [], []
    acc = torch.tensor(0.0)
    inputs = feats
    for depth in range(unroll):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            predicted = head(inputs, tokens)
            student = head.draft_logits(predicted).float()[mask]
        predicted = predicted.float()
        regs.append(F.smooth_l1_loss(predicted[mask], targets[mask]))
        clss.append(-(p * student.log_softmax(-1)).sum(-1).mean())
        if depth == 0:
            acc = (student.argmax(-1) == teacher.argmax(-1)).float().mean()
        inputs = torch.cat((feats[:, :1], predicted[:, :-1]), dim=1)
    return torch.stack(regs).mean(), torch.stack(clss).mean(), acc


def training_figures(
    head: EagleHead, held: list[Sequence], history: list[tuple[float, float, float]]
) -> dict[str, float]:
    head.eval()
    with torch.no_grad():
        reg, cls, acc = head_losses(head, held, 0.0) if held else (torch.tensor(0.0),) * 3
    first = history[: max(1, len(history) // 20)]
    last = history[-max(1, len(history) // 20) :]
    return {
        "steps": len(history),
        "train_cls_first": round(sum(h[1] for h in first) / len(first), 4),
        "train_cls_last": round(sum(h[1] for h in last) / len(last), 4),
        "held_out_reg": round(float(reg), 4),
        "held_out_cls": round(float(cls), 4),
        "held_out_top1": round(float(acc), 4),
    }
