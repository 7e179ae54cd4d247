"""The rules a proposal must satisfy before a target verifies it; no torch, so the scheduler shares them.

The scheduler checks a proposal when the draft service answers, and a target worker checks
the drafts of every step it is sent again: a bad draft never reaches a model, whichever
side is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from common.trees import tree_depths
from proto.messages import MAX_SPARSE_DIST_TOKENS

_SUM_TOLERANCE = 1e-3  # float32 probabilities renormalised by the draft sum to 1 well within this


class SparseDistLike(Protocol):
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def probs(self) -> list[float]: ...


def sparse_dist_problem(dist: SparseDistLike, vocab_size: int) -> str:
    """Why `dist` is not a distribution over the vocabulary ("" when it is); rejection sampling needs a true q."""
    if len(dist.token_ids) != len(dist.probs) or not dist.token_ids:
        return f"a distribution has {len(dist.token_ids)} tokens and {len(dist.probs)} probabilities"
    if len(dist.token_ids) > MAX_SPARSE_DIST_TOKENS:
        return f"a distribution lists {len(dist.token_ids)} tokens, more than {MAX_SPARSE_DIST_TOKENS}"
    if len(set(dist.token_ids)) != len(dist.token_ids) or (vocab_size and len(dist.token_ids) > vocab_size):
        return "a distribution repeats a token"
    if vocab_size and any(not 0 <= t < vocab_size for t in dist.token_ids):
        return "a distribution has a token outside the vocabulary"
    if any(not 0.0 <= q <= 1.0 for q in dist.probs) or abs(sum(dist.probs) - 1.0) > _SUM_TOLERANCE:
        return "a distribution has a probability outside [0, 1] or does not sum to 1"
    return ""


def drafts_problem(
    token_ids: Sequence[int], parents: Sequence[int] | None, dists: Sequence[SparseDistLike] | None, vocab_size: int
) -> str:
    """Why these draft tokens cannot be verified ("" when they can).

    `parents` makes them a token tree (common.trees), whose tokens must be point masses;
    `dists` gives, for sampled drafts, the distribution each token was drawn from, which
    must cover it.
    """
    if vocab_size and any(not 0 <= t < vocab_size for t in token_ids):
        return f"a draft token is outside the vocabulary 0..{vocab_size - 1}"
    if parents is not None:
        if dists is not None:
            return "a token tree with distributions (a tree's tokens must be point masses)"
        if len(parents) != len(token_ids):
            return f"{len(parents)} parents for {len(token_ids)} draft tokens"
        try:
            tree_depths(parents)
        except ValueError as exc:
            return str(exc)
    if dists is None:
        return ""
    if len(dists) != len(token_ids):
        return f"{len(dists)} distributions for {len(token_ids)} draft tokens"
    for token, dist in zip(token_ids, dists):
        if problem := sparse_dist_problem(dist, vocab_size):
            return problem
        if token not in dist.token_ids:
            return "a distribution does not cover the token drawn from it"
    return ""


def branch_problem(
    parents: Sequence[int], token_ids: Sequence[int], nodes: Sequence[int], branch_tokens: Sequence[int]
) -> str:
    """Why `nodes` are not a branch of the tree from its root down that holds `branch_tokens` ("" when they are)."""
    if len(nodes) != len(branch_tokens):
        return f"{len(nodes)} accepted nodes for {len(branch_tokens)} accepted tokens"
    above = -1
    for node, token in zip(nodes, branch_tokens):
        if not 0 <= node < len(parents) or parents[node] != above or token_ids[node] != token:
            return f"the accepted nodes {list(nodes)} are not a branch of the proposal holding {list(branch_tokens)}"
        above = node
    return ""
