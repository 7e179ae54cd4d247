"""Penalties and biases on a request's logits, row by row, before it samples or verifies.

Each row of a step's logits is the distribution of the token after some prefix of the
sequence: a decode row after the tokens that stand, a verify row after them and the
draft tokens of its branch. A row is changed from that prefix alone, so a verify row is
changed exactly as the decode step it stands for, and verification stays lossless. In
order (as vLLM does): the stop tokens are held back while the completion is shorter than
min_tokens, logit_bias is added, then the repetition penalty (a logit of a token the
prompt or completion holds is divided by it if positive, multiplied otherwise), the
frequency penalty (times the token's count in the completion) and the presence penalty
(once for a token the completion holds) are applied. Temperature, top-k and top-p come
after (modeling/sampling/draw.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from proto.messages import Penalties


def penalize(row: torch.Tensor, prefix: Sequence[int], num_prompt_tokens: int, penalties: Penalties) -> None:
    """Change logits `row` `[V]` (float32, in place): the token after `prefix`, whose first num_prompt_tokens are the
    prompt."""
    device = row.device
    completion = prefix[num_prompt_tokens:]
    if len(completion) < penalties.min_tokens and penalties.stop_token_ids:
        row[_ids(penalties.stop_token_ids, device)] = float("-inf")
    if penalties.logit_bias:
        ids = _ids(list(penalties.logit_bias), device)
        row[ids] += torch.tensor(list(penalties.logit_bias.values()), dtype=row.dtype, device=device)
    if penalties.repetition != 1.0 and prefix:
        seen = torch.unique(_ids(list(prefix), device))
        values = row[seen]
        row[seen] = torch.where(values > 0, values / penalties.repetition, values * penalties.repetition)
    if (penalties.frequency or penalties.presence) and completion:
        counts = torch.bincount(_ids(list(completion), device), minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
        row -= counts * penalties.frequency + (counts > 0).to(row.dtype) * penalties.presence


def penalize_rows(
    rows: torch.Tensor, prefixes: Sequence[Sequence[int]], num_prompt_tokens: int, penalties: Penalties
) -> None:
    """penalize each of rows `[R, V]` after its own prefix."""
    for row, prefix in zip(rows, prefixes, strict=True):
        penalize(row, prefix, num_prompt_tokens, penalties)


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
