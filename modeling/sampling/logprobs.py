"""Log-probabilities of tokens where they stand, with the likeliest alternatives there.

The distribution is the one a sampled token is drawn from before its top-k or top-p cut:
the logits divided by the temperature, or the model's own for a greedy request (and for
a prompt, which nobody sampled). A speculative step's rows are bit for bit the decode
steps' they stand for (modeling/kernels/invariance.py) and each row is reduced alone, so a token's
log-probability is the same with and without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from proto.messages import GREEDY_BELOW, TokenLogprob, TopLogprob


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], num_top: int, temperature: float = 1.0
) -> list[TokenLogprob]:
    """Row i of logits `[N, V]` is where token_ids[i] was drawn:
    its log-probability there and the `num_top` likeliest."""
    if logits.shape[0] != len(token_ids):
        raise ValueError(f"{logits.shape[0]} rows of logits for {len(token_ids)} tokens")
    if not token_ids:
        return []
    scaled = logits.float()
    if temperature >= GREEDY_BELOW:
        scaled = scaled / temperature
    logp = torch.log_softmax(scaled, dim=-1)  # [N, V]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logp.device)
    chosen = logp.gather(-1, ids[:, None]).squeeze(-1).tolist()
    if num_top <= 0:
        return [TokenLogprob(value, []) for value in chosen]
    best, order = torch.topk(logp, min(num_top, logp.shape[-1]), dim=-1)
    return [
        TokenLogprob(value, [TopLogprob(t, v) for t, v in zip(top_ids, top_values)])
        for value, top_ids, top_values in zip(chosen, order.tolist(), best.tolist())
    ]
