"""Token trees: several guesses verified in one target pass, each guess a node under the one it continues.

A tree is given by its nodes' tokens and their parents: node i's parent is an earlier
node, or -1 for the sequence's last token (the root). A chain is the tree whose node i
has parent i - 1. The target scores every node as the decode step of its own branch
would (modeling/model/batch.py), and verification follows the branch the target itself
chooses, by its argmax or by its own seeded draws (modeling/sampling/rejection.py).
"""

from __future__ import annotations

from collections.abc import Sequence


def tree_depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth (1 under the root); raises ValueError unless every parent comes before its child."""
    depths: list[int] = []
    for node, parent in enumerate(parents):
        if not -1 <= parent < node:
            raise ValueError(
                f"tree node {node} has parent {parent}: parents must come before their children (-1: the root)"
            )
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def is_chain(parents: Sequence[int]) -> bool:
    return all(parent == node - 1 for node, parent in enumerate(parents))


def parents_or_chain(parents: Sequence[int] | None, num_nodes: int) -> Sequence[int]:
    """A proposal's parents: its tree's, or a chain's when it has none."""
    return parents if parents is not None else range(-1, num_nodes - 1)


def child_holding(parents: Sequence[int], token_ids: Sequence[int], at: int, token: int) -> int | None:
    """The first child of node `at` (-1: the root) that holds `token`, if any."""
    return next(
        (node for node in range(at + 1, len(parents)) if parents[node] == at and token_ids[node] == token), None
    )


def follow(parents: Sequence[int], token_ids: Sequence[int], branch_tokens: Sequence[int]) -> list[int] | None:
    """The nodes that hold `branch_tokens` from the root down (the first such child where siblings repeat a token),
    or None when the tree has no such branch."""
    path: list[int] = []
    for token in branch_tokens:
        node = child_holding(parents, token_ids, path[-1] if path else -1, token)
        if node is None:
            return None
        path.append(node)
    return path


def branch_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root down to `node`, itself included."""
    branch: list[int] = []
    while node >= 0:
        branch.append(node)
        node = parents[node]
    return branch[::-1]


def leading_nodes(branch: Sequence[int]) -> int:
    """How many of a branch's nodes are the tree's first nodes in order (0, 1, 2, ...): the part of it that a holder
    of the tree's tokens in node order already holds in place."""
    count = 0
    while count < len(branch) and branch[count] == count:
        count += 1
    return count


def best_tree(
    chances: dict[tuple[int, ...], float], budget: int, min_chance: float = 0.0
) -> tuple[list[int], list[int]]:
    """The `budget` likeliest branches' nodes, none less likely than `min_chance`, as a tree: (tokens, parents)
    (`scored_tree`, without the nodes' chances)."""
    token_ids, parents, _ = scored_tree(chances, budget, min_chance)
    return token_ids, parents


def scored_tree(
    chances: dict[tuple[int, ...], float], budget: int, min_chance: float = 0.0
) -> tuple[list[int], list[int], list[float]]:
    """The `budget` likeliest branches' nodes, none less likely than `min_chance`, as a tree: (tokens, parents, each
    node's chance).

    `chances` maps a branch (its tokens from the root) to the chance that the target
    writes it; a branch whose shorter part is missing is left out. Every node is scored
    no higher than its parent (a branch is no likelier than its start), so the chosen
    nodes' parents are chosen too; picking the likeliest nodes maximises the number of
    tokens a greedy verification accepts on average (the sum of the nodes' chances). Nodes
    come depth first, likeliest child first: the likeliest branch is nodes 0, 1, 2, ...
    """
    capped: dict[tuple[int, ...], float] = {}
    for branch in sorted(chances, key=len):
        shorter = branch[:-1]
        if shorter and shorter not in capped:
            continue
        capped[branch] = min(chances[branch], capped[shorter]) if shorter else chances[branch]
    ranked = sorted(
        (branch for branch in capped if capped[branch] >= min_chance),
        key=lambda branch: (-capped[branch], len(branch), branch),
    )
    children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
    for branch in ranked[:budget]:  # in rank order: each node's children likeliest first
        children.setdefault(branch[:-1], []).append(branch)
    token_ids: list[int] = []
    parents: list[int] = []
    node_chances: list[float] = []
    stack: list[tuple[tuple[int, ...], int]] = [(child, -1) for child in reversed(children.get((), []))]
    while stack:
        branch, parent = stack.pop()
        token_ids.append(branch[-1])
        parents.append(parent)
        node_chances.append(capped[branch])
        stack.extend((child, len(token_ids) - 1) for child in reversed(children.get(branch, [])))
    return token_ids, parents, node_chances
