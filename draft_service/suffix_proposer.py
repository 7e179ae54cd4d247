"""The suffix proposer (`--draft suffix`): prompt lookup, then the text served to the request's tenant, merged into
one token tree (draft_service/traffic.py: whose text, and how it is held to what the target accepted)."""

from __future__ import annotations

from common.text.phrases import MIN_CHANCE
from draft_service.prompt_lookup import LookupProposer, NgramProposer
from draft_service.proposer import ProposeInput, Proposed
from draft_service.traffic import TrafficDrafts
from draft_service.tree_merge import merged_tree


class SuffixProposer(LookupProposer):
    """Prompt lookup (the request's own text first), then the suffix store of its tenant's text."""

    def __init__(self, traffic: TrafficDrafts, prompt_lookup: NgramProposer, trees: bool = True) -> None:
        self.traffic, self._prompt_lookup, self._trees = traffic, prompt_lookup, trees

    def phases(self):  # type: ignore[no-untyped-def]
        return self._prompt_lookup.phases()

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        return self._prompt_lookup.lookup(tokens, k)

    def forget(self, request_id: str) -> None:
        self.traffic.forget(request_id)

    def propose(self, batch: list[ProposeInput]) -> list[Proposed]:
        """A tree of the lookup's chain and the store's branches (each likelier than MIN_CHANCE times the sequences
        proposed for at once), or its likeliest chain without `trees`."""
        min_chance = MIN_CHANCE * len(batch)
        proposals = []
        for item in batch:
            chances = self.traffic.chances(item.request_id, item.tenant, item.token_ids, item.num_tokens, min_chance)
            lookup = self._prompt_lookup.lookup(item.token_ids, item.num_tokens)
            token_ids, parents, node_chances = merged_tree(chances, lookup, item.num_tokens, min_chance)
            if not self._trees and parents is not None:
                token_ids, parents = _likeliest_chain(token_ids, parents), None
                node_chances = node_chances[: len(token_ids)]
            source = "lookup" if lookup else "suffix"
            proposals.append(Proposed(token_ids, parents=parents, source=source, chances=node_chances))
        return proposals


def _likeliest_chain(token_ids: list[int], parents: list[int]) -> list[int]:
    """A tree's first branch: nodes come depth first, likeliest child first (common.trees.best_tree)."""
    chain = [token_ids[0]]
    for node in range(1, len(token_ids)):
        if parents[node] != node - 1:
            break
        chain.append(token_ids[node])
    return chain
