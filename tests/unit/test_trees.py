"""Token trees (common/trees.py): their shape, the branch greedy verification follows, and the tree a draft builds."""

from __future__ import annotations

import random

import pytest

import torch

from modeling.sampling.rejection import verify_greedy, verify_tree_greedy, verify_tree_sampled
from modeling.sampling.draw import draw, generator_for, target_probs
from proto.messages import SamplingParams
from common.trees import best_tree, follow, is_chain, leading_nodes, scored_tree, tree_depths


def branches(token_ids: list[int], parents: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for token, parent in zip(token_ids, parents):
        out.append((out[parent] if parent >= 0 else ()) + (token,))
    return out


def test_depths_chains_and_branches() -> None:
    parents = [-1, 0, -1, 2, 1]
    assert tree_depths(parents) == [1, 2, 1, 2, 3]
    assert is_chain([-1, 0, 1]) and is_chain([]) and not is_chain(parents)
    tokens = [5, 6, 5, 7, 8]
    assert follow(parents, tokens, [5, 6, 8]) == [0, 1, 4]
    assert follow(parents, tokens, [5, 7]) is None  # the first 5 is followed; its child is 6, not 7
    assert follow(parents, tokens, []) == []
    assert leading_nodes([0, 1, 4]) == 2 and leading_nodes([2, 3]) == 0
    with pytest.raises(ValueError, match="parent"):
        tree_depths([-1, 1])


def test_greedy_tree_verification_follows_the_targets_choices() -> None:
    tokens, parents = [5, 9, 6, 7, 8], [-1, -1, 0, 1, 3]
    # best[0] after the root, best[1 + i] after node i: the target says 9, then 7, then 8, then 4.
    best = [9, 0, 7, 0, 8, 4]
    verdict, path = verify_tree_greedy(best, tokens, parents)
    assert (verdict.token_ids, verdict.num_accepted, path) == ([9, 7, 8, 4], 3, [1, 3, 4])
    verdict, path = verify_tree_greedy([3, 0, 0, 0, 0, 0], tokens, parents)
    assert (verdict.token_ids, verdict.num_accepted, path) == ([3], 0, [])


def test_sampled_tree_verification_follows_the_targets_own_draws() -> None:
    """Each token is plain sampling's draw at its position (generator of (seed, position));
    a child holding it is kept."""
    torch.manual_seed(0)
    rows = torch.randn(6, 5) * 2  # row 0 after the root, row 1 + i after node i
    params = SamplingParams(temperature=0.9, seed=7)

    def plain(row: int, depth: int) -> int:  # what plain sampling draws from that row at position 10 + depth
        return draw(target_probs(rows[row], params), generator_for(params.seed, 10 + depth, rows.device))

    first = plain(0, 0)
    second = plain(2, 1)  # after node 1, which will hold `first`
    third = plain(4, 2)  # after node 3, which will hold `second`
    tokens = [(first + 1) % 5, first, (second + 1) % 5, second, (first + 2) % 5]
    parents = [-1, -1, 1, 1, -1]
    verdict, path = verify_tree_sampled(rows, tokens, parents, params, 10)
    assert path == [1, 3] and verdict.token_ids == [first, second, third] and verdict.num_accepted == 2


def test_sampled_tree_verification_draws_the_first_token_from_p_whatever_the_tree() -> None:
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(p).repeat(4, 1)
    tokens, parents = [0, 1, 3], [-1, -1, 0]  # guesses 0 and 1 at the first level, 3 under 0
    counts = torch.zeros(4)
    for seed in range(4000):
        verdict, _ = verify_tree_sampled(logits, tokens, parents, SamplingParams(temperature=1.0, seed=seed), 0)
        counts[verdict.token_ids[0]] += 1
    expected = p * 4000
    assert float(((counts - expected) ** 2 / expected).sum()) < 16.27  # chi-square, 3 degrees of freedom, 99.9%


def test_a_chain_verified_as_a_tree_gives_what_chain_verification_gives() -> None:
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randrange(0, 7)
        drafts = [rng.randrange(3) for _ in range(k)]
        best = [rng.randrange(3) for _ in range(k + 1)]
        verdict, path = verify_tree_greedy(best, drafts, list(range(-1, k - 1)))
        assert verdict == verify_greedy(best, drafts) and path == list(range(verdict.num_accepted))


def test_the_best_tree_keeps_the_likeliest_nodes_each_under_its_parent_likeliest_branch_first() -> None:
    chances = {(1,): 0.6, (1, 2): 0.5, (1, 2, 3): 0.45, (4,): 0.3, (4, 5): 0.35, (1, 7): 0.05, (9, 9): 0.9}
    tokens, parents = best_tree(chances, 5)
    # (9, 9) has no (9,): left out; (4, 5) is capped at its parent's 0.3; (1, 7) is the least likely and cut.
    assert branches(tokens, parents) == [(1,), (1, 2), (1, 2, 3), (4,), (4, 5)]
    assert parents == [-1, 0, 1, -1, 3]
    assert best_tree(chances, 2) == ([1, 2], [-1, 0])
    assert best_tree({}, 4) == ([], [])
    assert branches(*best_tree(chances, 5, min_chance=0.4)) == [(1,), (1, 2), (1, 2, 3)]  # at least as likely only
    assert scored_tree(chances, 5) == (tokens, parents, [0.6, 0.5, 0.45, 0.3, 0.3])  # each node's chance, capped


def test_the_best_tree_is_closed_under_parents_and_in_depth_first_order() -> None:
    rng = random.Random(1)
    for _ in range(200):
        chances: dict[tuple[int, ...], float] = {}
        for _ in range(rng.randrange(1, 30)):
            branch = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 5)))
            chances[branch] = rng.random()
        budget = rng.randrange(1, 8)
        tokens, parents = best_tree(chances, budget)
        tree_depths(parents)  # parents come first
        chosen = branches(tokens, parents)
        assert len(chosen) == len(set(chosen)) <= budget
        assert all(branch in chances for branch in chosen)
        # Depth first: a node's subtree follows it directly.
        for node, branch in enumerate(chosen):
            below = [i for i, other in enumerate(chosen) if other[: len(branch)] == branch]
            assert below == list(range(node, node + len(below)))
