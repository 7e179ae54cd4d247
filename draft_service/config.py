"""The draft service's frozen configuration, parsed and validated once at the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from common import process_config, settings
from common.arguments import below_problem
from common.draft_spec import DraftKind, DraftSpec
from common.process_config import ProcessConfig
from draft_service.traffic import SuffixScope
from common.settings.choices import AUTO
from modeling.model.engine import default_dtype
from modeling.kernels.blocks import QuantizationError, weight_blocks
from proto.messages import MAX_SPARSE_DIST_TOKENS


@dataclass(frozen=True)
class DraftConfig:
    process: ProcessConfig  # id, scheduler address, device, dtype, deadlines, threads, status file
    proposer: DraftSpec
    target_model: Path | None  # the target's folder: a distilled draft (phrases, head) must have been made for it
    max_draft_tokens: int  # the longest proposal it makes (k)
    head_draft_tokens: int  # eagle+ngram, eagle+phrases: the longest proposal the head makes (a lookup's may reach k)
    token_trees: bool  # phrases: a token tree of guesses, not one chain
    ngram_min: int  # n-gram lookup tries n = ngram_max down to ngram_min
    ngram_max: int
    max_model_len: int  # tokens per sequence it can hold
    num_seqs: int  # sequences it holds at once (a draft model: its KV cache holds this many of max_model_len)
    draft_top_k: int  # a sampled draft token is drawn from the draft's k most likely tokens at most
    quantization: str = "none"  # a draft model: GGUF blocks served as they are (modeling/kernels/blocks.py), or "none"
    suffix_cache_tokens: int = 0  # served tokens kept to draft from (suffix, phrases); 0: none
    suffix_scope: SuffixScope = "tenant"  # whose served text drafts for a request (draft_service/traffic.py)


DEFAULT_PROPOSER = "default"  # --proposer's default: the shipped draft for its target, else prompt lookup


def default_proposer(target_model: Path | None) -> DraftSpec:
    """Prompt lookup, then the phrases `specserve distill` made for the embedded default model (drafts/), when the
    target is that model; prompt lookup for any other (or none named)."""
    from modeling.model.eagle import DraftMismatch, check_target
    from modeling.model.store import default_draft_dir

    if target_model is not None:
        try:
            check_target(default_draft_dir(), target_model)
            return DraftSpec(DraftKind.PHRASES, default_draft_dir())
        except (DraftMismatch, OSError):  # another model, or an install without the repository's drafts/ folder
            pass
    return DraftSpec(DraftKind.NGRAM)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, "draft")


def from_arguments(args: argparse.Namespace) -> DraftConfig:
    """Raises ValueError naming the setting."""
    if problem := below_problem(
        args,
        (
            "max_draft_tokens",
            "head_draft_tokens",
            "ngram_min",
            "max_model_len",
            "num_seqs",
            "num_targets",
            "draft_top_k",
        ),
        1,
    ):
        raise ValueError(problem)
    if args.suffix_cache_tokens < 0:
        raise ValueError(f"--suffix-cache-tokens must be at least 0, got {args.suffix_cache_tokens}")
    if args.draft_top_k > MAX_SPARSE_DIST_TOKENS:  # the scheduler and the targets refuse a larger distribution
        raise ValueError(f"--draft-top-k {args.draft_top_k}: at most {MAX_SPARSE_DIST_TOKENS}")
    if args.dtype == AUTO:
        args = argparse.Namespace(**{**vars(args), "dtype": default_dtype(args.device)})
    process = process_config.from_arguments(args)
    if args.ngram_max < args.ngram_min:
        raise ValueError(f"--ngram-max ({args.ngram_max}) is below --ngram-min ({args.ngram_min})")
    proposer = (
        default_proposer(args.target_model)
        if args.proposer == DEFAULT_PROPOSER
        else DraftSpec.parse(args.proposer, flag="--proposer")
    )
    if proposer.needs_target_model and args.target_model is None:
        raise ValueError(
            f"--proposer {proposer.kind}:PATH needs --target-model "
            "(the target's folder: the draft is checked against it)"
        )
    if args.quantization != "none" and proposer.kind is not DraftKind.MODEL:
        raise ValueError(
            f"--quantization {args.quantization} is for a draft model (--proposer model:PATH), "
            f"not --proposer {proposer.kind}: the choice for it is none"
        )
    try:
        weight_blocks(proposer.path or Path("."), args.quantization)
    except QuantizationError as exc:
        raise ValueError(f"--quantization {exc}") from exc
    return DraftConfig(
        process=process,
        proposer=proposer,
        target_model=args.target_model,
        max_draft_tokens=args.max_draft_tokens,
        head_draft_tokens=args.head_draft_tokens,
        token_trees=args.token_trees,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        max_model_len=args.max_model_len,
        num_seqs=args.num_seqs * args.num_targets,
        draft_top_k=args.draft_top_k,
        quantization=args.quantization,
        suffix_cache_tokens=args.suffix_cache_tokens,
        suffix_scope=cast(SuffixScope, args.suffix_scope),  # one of its choices
    )
