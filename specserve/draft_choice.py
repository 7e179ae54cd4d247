"""`specserve up --draft`: the choice as given, the one made for a model when none is, and whether a draft fits it.

The default is decided as the draft service decides it (draft_service/config.py), so
`up`'s ready line names the draft that runs.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common.draft_spec import SERVING_KINDS, DraftKind, DraftSpec

NO_DRAFT = "none"
SHIPPED_DRAFT = "default"


@dataclass(frozen=True)
class DraftChoice:
    """`--draft` as given, which the ready line repeats, and the proposer it names (None: no draft service)."""

    name: str  # none, ngram, default or KIND:PATH
    proposer: DraftSpec | None  # its path absolute


def parse_draft(value: str) -> DraftChoice:
    """The argparse type of --draft."""
    if value == NO_DRAFT:
        return DraftChoice(value, None)
    if value == SHIPPED_DRAFT:
        return _shipped_draft()
    try:
        return DraftChoice(value, DraftSpec.parse(value, flag="--draft", kinds=SERVING_KINDS).absolute())
    except ValueError as error:
        with_path = [f"{kind}:PATH" for kind in SERVING_KINDS if kind not in (DraftKind.NGRAM, DraftKind.SUFFIX)]
        raise argparse.ArgumentTypeError(
            f"expected {NO_DRAFT}, {DraftKind.NGRAM}, {DraftKind.SUFFIX}, {SHIPPED_DRAFT}, {', '.join(with_path[:-1])} "
            f"or {with_path[-1]}, "
            f"got {value!r}"
        ) from error


def _shipped_draft() -> DraftChoice:
    """Prompt lookup, then the phrases `specserve distill` made for the embedded default model (drafts/)."""
    from modeling.model.store import default_draft_dir

    return DraftChoice(SHIPPED_DRAFT, DraftSpec(DraftKind.PHRASES, default_draft_dir()))


def default_draft(model: Path) -> DraftChoice:
    """The draft the draft service chooses for `model` unless told: the shipped one when it was trained for `model`
    (the embedded default), else prompt lookup."""
    from draft_service.config import default_proposer

    proposer = default_proposer(model)
    return DraftChoice(SHIPPED_DRAFT if proposer.kind is DraftKind.PHRASES else DraftKind.NGRAM.value, proposer)


def draft_problem(draft: DraftSpec, model: Path) -> str:
    """Why the draft cannot serve this target ("" when it can): one made for another model is refused here, not after
    the stack has started and the draft service has failed its start-up five times."""
    path = draft.path
    if path is None:  # prompt lookup: nothing to check
        return ""
    if not (path / "config.json").is_file():
        return f"{path} has no config.json"
    if draft.needs_target_model:
        from modeling.model.eagle import DraftMismatch, check_target

        try:
            check_target(path, model)
        except DraftMismatch as error:
            return str(error)
    if draft.kind is DraftKind.MODEL:
        from modeling.model.config import vocab_fingerprint

        if vocab_fingerprint(path) != vocab_fingerprint(model):
            return f"the draft model's vocabulary differs from --model's ({path})"
    return ""
