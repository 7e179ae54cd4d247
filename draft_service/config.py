"""The draft service's frozen configuration, parsed and validated once at the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import process_config
from common.arguments import below_problem
from common.draft_spec import DraftKind, DraftSpec
from common.process_config import ProcessConfig
from common.defaults import DRAFT_MAX_TOKENS, HEAD_DRAFT_TOKENS, MAX_MODEL_LEN
from modeling.engine import DTYPES
from modeling.quantized import QUANTIZATION_HELP, QuantizationError, weight_blocks
from proto.messages import MAX_SPARSE_DIST_TOKENS

PROPOSER_HELP = (
    "what proposes: 'ngram' (prompt lookup), 'model:PATH' (a draft model folder whose vocabulary matches the "
    "target's), 'phrases:PATH' (prompt lookup, then the target's own phrases kept in PATH by `specserve distill` for "
    "the target named by --target-model), 'eagle:PATH' (a draft head made by `specserve distill` for that target), "
    "'eagle+ngram:PATH' (prompt lookup, that head elsewhere), 'eagle+phrases:PATH' (prompt lookup, then the folder's "
    "phrases, its head elsewhere), or, for tests "
    "only, 'random:VOCAB_SIZE' (random tokens) and 'replay:FILE' (continuations from a JSON list of token-id sequences)"
)


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
    quantization: str = "none"  # a draft model: GGUF blocks served as they are (modeling/quantized.py), or "none"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--proposer", default="ngram", help=PROPOSER_HELP)
    parser.add_argument("--target-model", type=Path, default=None, help="the target's model folder (needed by phrases:PATH and the eagle kinds)")
    parser.add_argument("--max-draft-tokens", type=int, default=DRAFT_MAX_TOKENS,
                        help="the longest proposal it makes (the scheduler asks for k up to its own cap)")
    parser.add_argument("--head-draft-tokens", type=int, default=HEAD_DRAFT_TOKENS,
                        help="eagle+ngram, eagle+phrases: the longest proposal the head makes; a lookup's may be "
                             "--max-draft-tokens long")
    parser.add_argument("--token-trees", action=argparse.BooleanOptionalAction, default=True,
                        help="phrases: guess a token tree (the likeliest branches of the phrases and prompt lookup, "
                             "verified in one step); --no-token-trees: one chain")
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    parser.add_argument("--num-seqs", type=int, default=64,
                        help="sequences a draft model holds at once, for each target worker (see --num-targets)")
    parser.add_argument("--num-targets", type=int, default=1,
                        help="the target workers it drafts for: it holds --num-seqs times this many sequences")
    parser.add_argument("--draft-top-k", type=int, default=32)
    parser.add_argument("--quantization", default="none", help="for a draft model (--proposer model:PATH): "
                        + QUANTIZATION_HELP)
    process_config.add_arguments(parser, default_worker_id="draft-0", dtypes=DTYPES)


def from_arguments(args: argparse.Namespace) -> DraftConfig:
    """Raises ValueError naming the setting."""
    if problem := below_problem(args, ("max_draft_tokens", "head_draft_tokens", "ngram_min", "max_model_len", "num_seqs",
                                       "num_targets", "draft_top_k"), 1):
        raise ValueError(problem)
    if args.draft_top_k > MAX_SPARSE_DIST_TOKENS:  # the scheduler and the targets refuse a larger distribution
        raise ValueError(f"--draft-top-k {args.draft_top_k}: at most {MAX_SPARSE_DIST_TOKENS}")
    process = process_config.from_arguments(args)
    if args.ngram_max < args.ngram_min:
        raise ValueError(f"--ngram-max ({args.ngram_max}) is below --ngram-min ({args.ngram_min})")
    proposer = DraftSpec.parse(args.proposer, flag="--proposer")
    if proposer.needs_target_model and args.target_model is None:
        raise ValueError(f"--proposer {proposer.kind}:PATH needs --target-model (the target's folder: the draft is checked against it)")
    if args.quantization != "none" and proposer.kind is not DraftKind.MODEL:
        raise ValueError(f"--quantization {args.quantization} is for a draft model (--proposer model:PATH), "
                         f"not --proposer {proposer.kind}: the choice for it is none")
    try:
        weight_blocks(proposer.path or Path("."), args.quantization)
    except QuantizationError as exc:
        raise ValueError(str(exc)) from exc
    return DraftConfig(
        process=process, proposer=proposer, target_model=args.target_model,
        max_draft_tokens=args.max_draft_tokens, head_draft_tokens=args.head_draft_tokens, token_trees=args.token_trees,
        ngram_min=args.ngram_min, ngram_max=args.ngram_max, max_model_len=args.max_model_len,
        num_seqs=args.num_seqs * args.num_targets,
        draft_top_k=args.draft_top_k, quantization=args.quantization,
    )
