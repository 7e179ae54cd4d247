"""What proposes draft tokens, `KIND[:ARGUMENT]`, parsed once where a flag names it
(`--proposer`, `specserve up --draft`).

A library module, light enough for the command line: the draft service builds its
proposer from a DraftSpec, and `specserve up` decides its defaults and checks from one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from pathlib import Path

from common.defaults import HEAD_DRAFT_TOKENS, MODEL_SPEC_BATCH_THRESHOLD, NUM_SPECULATIVE_TOKENS, SPEC_BATCH_THRESHOLD


class DraftKind(enum.StrEnum):
    NGRAM = "ngram"  # prompt lookup
    SUFFIX = "suffix"  # prompt lookup, then the text served to the request's tenant (draft_service/suffix_store.py)
    PHRASES = "phrases"  # prompt lookup, then the target's own phrases in a folder made by `specserve distill`
    EAGLE = "eagle"  # the EAGLE-style draft head in such a folder
    EAGLE_NGRAM = "eagle+ngram"  # prompt lookup, else the folder's head
    EAGLE_PHRASES = "eagle+phrases"  # prompt lookup, then the folder's phrases, else its head
    MODEL = "model"  # a draft model folder whose vocabulary matches the target's
    RANDOM = "random"  # tests only: random tokens from a vocabulary of N
    REPLAY = "replay"  # tests only: continuations from a JSON list of token-id sequences


# The kinds by what they need: a draft head (which runs a model), a folder made by
# `specserve distill` for one target (so the target's folder), a model run per proposal.
HEAD_KINDS = frozenset({DraftKind.EAGLE, DraftKind.EAGLE_NGRAM, DraftKind.EAGLE_PHRASES})
DISTILLED_KINDS = frozenset({DraftKind.PHRASES, *HEAD_KINDS})
MODEL_KINDS = frozenset({DraftKind.MODEL, *HEAD_KINDS})
LOOKUP_THEN_HEAD_KINDS = (
    DraftKind.EAGLE_NGRAM,
    DraftKind.EAGLE_PHRASES,
)  # the head proposes only where no lookup matches
TEST_KINDS = frozenset({DraftKind.RANDOM, DraftKind.REPLAY})
SERVING_KINDS = tuple(kind for kind in DraftKind if kind not in TEST_KINDS)  # what `specserve up --draft` offers


@dataclass(frozen=True)
class DraftSpec:
    kind: DraftKind
    path: Path | None = (
        None  # the folder (model, the distilled kinds) or file (replay) it reads; None for ngram, random
    )
    vocab_size: int | None = None  # random only

    @classmethod
    def parse(cls, text: str, *, flag: str, kinds: tuple[DraftKind, ...] = tuple(DraftKind)) -> DraftSpec:
        """`ngram`, `random:N` or `KIND:PATH` for one of `kinds`; raises ValueError naming `flag` and the value."""
        name, colon, argument = text.partition(":")
        if name not in {kind.value for kind in kinds}:
            raise ValueError(f"{flag} {text!r}: the kind must be one of {', '.join(kinds)}")
        kind = DraftKind(name)
        if kind in (DraftKind.NGRAM, DraftKind.SUFFIX):
            if colon:
                raise ValueError(f"{flag} {text!r}: {kind} takes no argument")
            return cls(kind)
        if not argument:
            raise ValueError(
                f"{flag} {text!r}: {kind} needs {'the vocabulary size' if kind is DraftKind.RANDOM else 'a path'}, "
                f"{kind}:{'VOCAB_SIZE' if kind is DraftKind.RANDOM else 'PATH'}"
            )
        if kind is DraftKind.RANDOM:
            if not argument.isdigit():
                raise ValueError(f"{flag} {text!r}: random needs the vocabulary size, e.g. random:49152")
            return cls(kind, vocab_size=int(argument))
        return cls(kind, Path(argument))

    def __str__(self) -> str:
        """As a flag takes it: parse(str(spec)) == spec."""
        if self.vocab_size is not None:
            return f"{self.kind}:{self.vocab_size}"
        return self.kind.value if self.path is None else f"{self.kind}:{self.path}"

    def absolute(self) -> DraftSpec:
        """The same draft with its path made absolute (for a process started in another folder)."""
        return self if self.path is None else replace(self, path=self.path.resolve())

    @property
    def num_speculative_tokens(self) -> int:
        """k unless told: a head alone proposes HEAD_DRAFT_TOKENS, lookups (a head behind one included) more."""
        return HEAD_DRAFT_TOKENS if self.kind is DraftKind.EAGLE else NUM_SPECULATIVE_TOKENS

    @property
    def spec_batch_threshold(self) -> int:
        """The most sequences a step speculates for unless told: fewer where a model runs for each proposal."""
        return MODEL_SPEC_BATCH_THRESHOLD if self.runs_model else SPEC_BATCH_THRESHOLD

    @property
    def runs_model(self) -> bool:
        """A model (a draft model or a head) runs for each proposal:
        it wants a device, and speculation in small batches."""
        return self.kind in MODEL_KINDS

    @property
    def needs_target_model(self) -> bool:
        """Made by `specserve distill` for one target, whose folder the draft service then checks it against."""
        return self.kind in DISTILLED_KINDS

    @property
    def lookup_then_head(self) -> bool:
        """A lookup proposes first, the head only where none matches (so --head-draft-tokens means something)."""
        return self.kind in LOOKUP_THEN_HEAD_KINDS

    @property
    def proposes_trees(self) -> bool:
        """Phrases may propose a token tree of guesses rather than one chain (--no-token-trees turns it off)."""
        return self.kind in (DraftKind.PHRASES, DraftKind.SUFFIX)

    @property
    def model_path(self) -> Path | None:
        """The folder of a draft model or distilled draft, whose name the service announces; None for the others."""
        return self.path if self.kind is DraftKind.MODEL or self.needs_target_model else None
