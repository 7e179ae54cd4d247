"""Guesses of several kinds merged into one token tree: prompt lookup's chain beside the branches of phrases or of the
text served, each scored with the chance the target writes it (common.trees.best_tree keeps the likeliest)."""

from __future__ import annotations

from common.trees import is_chain, scored_tree

# In a token tree: how often prompt lookup's guess at each depth is the target's next token,
# given the guesses before it were (n-gram lengths 2-4), measured on the tuning requests
# (bench/spec_prompts.py TUNING) as common.text.phrases.TRUST_BY_MATCH was.
LOOKUP_TRUST = (0.74, 0.82, 0.84, 0.9, 0.91, 0.92)


def merged_tree(
    chances: dict[tuple[int, ...], float], lookup: list[int], k: int, min_chance: float
) -> tuple[list[int], list[int] | None, list[float]]:
    """Prompt lookup's chain added to `chances` (each depth as likely as LOOKUP_TRUST says), then the k likeliest
    branches as a tree: (tokens, parents; None for a chain, each node's chance)."""
    chance = 1.0
    for depth in range(len(lookup)):
        chance *= LOOKUP_TRUST[min(depth, len(LOOKUP_TRUST) - 1)]
        branch = tuple(lookup[: depth + 1])
        chances[branch] = max(chances.get(branch, 0.0), chance)
    token_ids, parents, node_chances = scored_tree(chances, k, min_chance)
    return token_ids, None if is_chain(parents) else parents, node_chances
