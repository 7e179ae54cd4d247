"""Verification of draft tokens against the target's logits: greedy matching or lossless rejection sampling.

For one sequence the target scored k+1 positions in one pass: the logits after its last
token and after each of the k draft tokens. Row i is the target's distribution p_i for
the token at position `first_position + i`.

- Greedy: accept the draft tokens while they equal the target's argmax, then add the
  argmax at the first mismatch (or after the last draft token: the bonus token).
- Sampling: accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)), where q_i
  is exactly what the draft drew x_i from; at the first rejection draw from the
  normalised max(0, p_i - q_i) and stop; when all k are accepted draw the bonus token
  from p_k. The emitted tokens then follow the target distribution exactly, whatever q
  is (Leviathan et al. 2023, Chen et al. 2023). A deterministic proposer is q = a point
  mass on its token.

Every random draw uses a generator that is a pure function of (seed, position), so a
seeded request gives the same tokens on every run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from common.draft_rules import SparseDistLike
from common.trees import child_holding
from modeling.sampling.draw import SamplingLike, draw, generator_for, is_greedy, target_probs

# The acceptance test at a position uses its own stream, apart from the token draw there.
_ACCEPT_STREAM = 0x5DEECE66D


@dataclass(frozen=True)
class Verdict:
    token_ids: list[int]  # the accepted draft tokens, then one token from the target
    num_accepted: int


def verify(
    logits: torch.Tensor,
    draft_token_ids: Sequence[int],
    draft_dists: Sequence[SparseDistLike] | None,
    params: SamplingLike,
    first_position: int,
) -> Verdict:
    """Accept a prefix of sampled drafts: logits `[k+1, V]` for k = len(draft_token_ids) (k may be 0).

    `draft_dists[i]` is the distribution draft token i was sampled from; None means every
    draft token had probability 1. A greedy request's drafts are verified from the
    target's argmax instead (verify_greedy, verify_tree_greedy).
    """
    k = len(draft_token_ids)
    if logits.shape[0] != k + 1:
        raise ValueError(f"verify needs {k + 1} rows of logits for {k} draft tokens, got {logits.shape[0]}")
    if is_greedy(params):
        raise ValueError(f"verify samples: temperature {params.temperature} is greedy (use verify_greedy)")
    if draft_dists is not None and len(draft_dists) != k:
        raise ValueError(f"{k} draft tokens but {len(draft_dists)} draft distributions")
    p = target_probs(logits, params)  # [k+1, V]
    for i, token in enumerate(draft_token_ids):
        position = first_position + i
        q = _dense(draft_dists[i] if draft_dists is not None else None, token, p.shape[-1], p.device)
        p_token, q_token = float(p[i, token]), float(q[token])
        accept_generator = generator_for(params.seed ^ _ACCEPT_STREAM, position, p.device)
        u = float(torch.rand((), generator=accept_generator, device=p.device))
        if q_token > 0 and u * q_token < p_token:  # u < p/q, without dividing
            continue
        residual = (p[i] - q).clamp_min_(0)
        if float(residual.sum()) <= 0:  # p <= q everywhere means p == q: rejection is impossible
            residual = p[i]
        return Verdict([*draft_token_ids[:i], draw(residual, generator_for(params.seed, position, p.device))], i)
    bonus = draw(p[k], generator_for(params.seed, first_position + k, p.device))
    return Verdict([*draft_token_ids, bonus], k)


def verify_greedy(best: Sequence[int], draft_token_ids: Sequence[int]) -> Verdict:
    """Greedy verification from the target's argmax at each of the k+1 positions."""
    accepted = 0
    while accepted < len(draft_token_ids) and draft_token_ids[accepted] == best[accepted]:
        accepted += 1
    return Verdict([*draft_token_ids[:accepted], best[accepted]], accepted)


def verify_tree_greedy(
    best: Sequence[int], draft_token_ids: Sequence[int], parents: Sequence[int]
) -> tuple[Verdict, list[int]]:
    """Greedy verification of a token tree (modeling.model.batch.SeqSpan.parents): `best[0]` is the target's
    argmax after the last standing token, `best[1 + i]` after node i.

    From the root, follow the child that holds the target's choice while there is one
    (the first such child, should siblings repeat a token); the nodes followed are
    accepted, then the target's choice after the last of them. Returns the verdict and
    the accepted nodes' indices, root to leaf. A chain gives what verify_greedy gives.
    """
    return _follow_choices(draft_token_ids, parents, lambda row, depth: best[row])


def verify_tree_sampled(
    logits: torch.Tensor,
    draft_token_ids: Sequence[int],
    parents: Sequence[int],
    params: SamplingLike,
    first_position: int,
) -> tuple[Verdict, list[int]]:
    """Sampled verification of point-mass drafts, a chain or a tree: logits `[k+1, V]`, row 0 after the last standing
    token (at `first_position`), row 1 + i after node i.

    At each step the target's own token is drawn, exactly as plain sampling draws it
    there (the same distribution, the generator of (seed, position)); the child that
    holds it is accepted and the walk goes on from it, else the drawn token ends the
    step. Every token is then what plain sampling gives at its position, so a seeded
    request gives the same tokens with or without these drafts. (For a point mass this
    is rejection sampling's law: draft d is kept with probability p(d), and otherwise the
    token follows p without d.)
    """
    if logits.shape[0] != len(draft_token_ids) + 1:
        raise ValueError(
            f"verify needs {len(draft_token_ids) + 1} rows of logits for {len(draft_token_ids)} draft tokens, "
            f"got {logits.shape[0]}"
        )
    return _follow_choices(
        draft_token_ids,
        parents,
        lambda row, depth: draw(
            target_probs(logits[row], params), generator_for(params.seed, first_position + depth, logits.device)
        ),
    )


def _follow_choices(
    draft_token_ids: Sequence[int], parents: Sequence[int], choose: Callable[[int, int], int]
) -> tuple[Verdict, list[int]]:
    """From the root, the target's token `choose(row, depth)` after the node reached (row 0: the root's), then the
    child that holds it, while there is one. Returns the verdict and the nodes followed."""
    path: list[int] = []
    while True:
        token = choose(path[-1] + 1 if path else 0, len(path))
        node = child_holding(parents, draft_token_ids, path[-1] if path else -1, token)
        if node is None:
            return Verdict([*(draft_token_ids[n] for n in path), token], len(path)), path
        path.append(node)


def _dense(dist: SparseDistLike | None, token: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """q as a full vector; None is a point mass on `token`."""
    q = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    if dist is None:
        q[token] = 1.0
    else:
        q[torch.tensor(dist.token_ids, dtype=torch.long, device=device)] = torch.tensor(
            dist.probs, dtype=torch.float32, device=device
        )
    return q
