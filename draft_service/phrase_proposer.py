"""The phrase proposer: prompt lookup, then the target's own phrases from its draft folder, merged into a token tree.

The phrases (a `PhraseStore`, written by `specserve distill` beside the head) are what most
often followed the longest match of the sequence's last tokens in the target's answers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from common.text.phrases import FILE_NAME as PHRASE_FILE
from common.text.phrases import MIN_CHANCE as PHRASE_MIN_CHANCE
from common.text.phrases import MIN_CONTEXT as PHRASE_MIN_CONTEXT
from common.text.phrases import PhraseStore
from draft_service.prompt_lookup import LookupProposer, NgramProposer
from draft_service.proposer import ProposeInput, Proposed, nothing
from draft_service.traffic import TrafficDrafts
from draft_service.tree_merge import merged_tree
from modeling.model.config import ModelConfig
from modeling.model.eagle import check_target


class PhraseProposer(LookupProposer):
    """Prompt lookup, then the target's own phrases (common/text/phrases.py) from a draft folder made for this target.

    `min_context`: the shortest phrase match it proposes from. Alone it takes any match
    (a short one proposes one or two tokens); before a head, only matches of FULL_CONTEXT
    tokens, and the head guesses where those fail (its first token is right more often
    than a short match's).
    """

    def __init__(
        self,
        folder: Path,
        target_folder: Path,
        prompt_lookup: NgramProposer,
        min_context: int = PHRASE_MIN_CONTEXT,
        trees: bool = True,
        traffic: TrafficDrafts | None = None,
    ) -> None:
        meta = check_target(folder, target_folder)  # refuses a folder made for another target, as a head does
        self.vocab_size = ModelConfig.from_folder(target_folder).vocab_size
        self.vocab_fingerprint = meta.vocab_fingerprint
        self.target_fingerprint = meta.target_fingerprint
        self._folder, self._prompt_lookup, self._min_context, self._trees = folder, prompt_lookup, min_context, trees
        self._phrases: PhraseStore | None = None
        self.traffic = traffic  # the text served, drafted from beside the phrases (None: not kept)

    def phases(self) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
        return self._load, nothing, self._prompt_lookup.self_check

    def _load(self) -> None:
        self._phrases = PhraseStore.load(self._folder, self.vocab_size)
        if self._phrases is None:
            raise FileNotFoundError(
                f"{self._folder} has no {PHRASE_FILE} (`specserve distill` writes one beside the head)"
            )

    @property
    def num_phrase_tokens(self) -> int:
        return self._phrases.num_tokens if self._phrases is not None else 0

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        return self.find(tokens, k).token_ids

    def find(self, tokens: list[int], k: int) -> Proposed:
        assert self._phrases is not None  # loaded
        if found := self._prompt_lookup.lookup(tokens, k):
            return Proposed(found, source="lookup")
        return Proposed(self._phrases.continue_(tokens, k, self._min_context), source="phrases")

    def propose(self, batch: list[ProposeInput]) -> list[Proposed]:
        """A token tree of up to k nodes (with `trees`; its tokens are point masses, verified greedily or by the
        target's own draws), else the lookup's chain.

        A tree's node must be likelier than MIN_CHANCE times the sequences proposed for
        at once: alone in its step a sequence's few extra rows cost the target almost
        nothing, but in a step of many every row costs its share.
        """
        min_chance = PHRASE_MIN_CHANCE * len(batch)
        proposals = []
        for item in batch:
            served = {}
            if self.traffic is not None:
                served = self.traffic.chances(item.request_id, item.tenant, item.token_ids, item.num_tokens, min_chance)
            if self._trees:
                proposals.append(self.tree(item.token_ids, item.num_tokens, min_chance, served))
            else:
                proposals.append(self.find(item.token_ids, item.num_tokens))
        return proposals

    def forget(self, request_id: str) -> None:
        if self.traffic is not None:
            self.traffic.forget(request_id)

    def tree(
        self,
        tokens: list[int],
        k: int,
        min_chance: float = PHRASE_MIN_CHANCE,
        served: dict[tuple[int, ...], float] | None = None,
    ) -> Proposed:
        """The k likeliest guesses (none less likely than min_chance) of the phrases' branches, the `served` text's
        (the suffix store's) and prompt lookup's chain, as one token tree (its source "lookup" where prompt lookup
        found a chain, else "suffix" where the served text's likeliest guess leads, else "phrases")."""
        assert self._phrases is not None  # loaded
        chances = self._phrases.guesses(tokens, k, self._min_context, min_chance)
        served = served or {}
        led_by_served = bool(served) and max(served.values()) > max(chances.values(), default=0.0)
        for branch, chance in served.items():
            chances[branch] = max(chances.get(branch, 0.0), chance)
        lookup = self._prompt_lookup.lookup(tokens, k)
        token_ids, parents, node_chances = merged_tree(chances, lookup, k, min_chance)
        source = "lookup" if lookup else "suffix" if led_by_served else "phrases"
        return Proposed(token_ids, parents=parents, source=source, chances=node_chances)
