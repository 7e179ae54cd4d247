"""The draft service's frozen configuration, parsed and validated once at the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common.lifecycle_process import add_process_arguments, check_process_arguments
from draft_service.defaults import DISTILLED_KINDS, HEAD_DRAFT_TOKENS, MODEL_KINDS
from modeling.engine import DTYPES

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
    worker_id: str
    scheduler_address: str
    proposer: str  # see PROPOSER_HELP
    target_model: Path | None  # the target's folder: a distilled draft (phrases, head) must have been made for it
    max_draft_tokens: int  # the longest proposal it makes (k)
    head_draft_tokens: int  # eagle+ngram, eagle+phrases: the longest proposal the head makes (a lookup's may reach k)
    token_trees: bool  # phrases: a token tree of guesses, not one chain
    ngram_min: int  # n-gram lookup tries n = ngram_max down to ngram_min
    ngram_max: int
    max_model_len: int  # tokens per sequence it can hold
    num_seqs: int  # sequences it holds at once (draft model: KV slots)
    device: str
    dtype: str
    draft_top_k: int  # a sampled draft token is drawn from the draft's k most likely tokens at most
    heartbeat_interval_s: float
    phase_timeout_s: float  # a start-up phase running longer ends the process (FAILED)
    step_timeout_s: float  # a step (proposal) running longer ends the process (FAILED)
    drain_timeout_s: float  # after SIGTERM, how long work in flight may take before the process stops anyway
    num_threads: int  # torch intra-op threads on CPU; 0 = torch's default
    status_file: Path | None

    @property
    def model_path(self) -> Path | None:
        kind, _, path = self.proposer.partition(":")
        return Path(path) if kind in ("model", *DISTILLED_KINDS) else None

    @property
    def runs_model(self) -> bool:
        return self.proposer.partition(":")[0] in MODEL_KINDS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker-id", default="draft-0")
    parser.add_argument("--scheduler-address", default="tcp://127.0.0.1:5556")
    parser.add_argument("--proposer", default="ngram", help=PROPOSER_HELP)
    parser.add_argument("--target-model", type=Path, default=None, help="the target's model folder (needed by phrases:PATH and the eagle kinds)")
    parser.add_argument("--max-draft-tokens", type=int, default=8)
    parser.add_argument("--head-draft-tokens", type=int, default=HEAD_DRAFT_TOKENS,
                        help="eagle+ngram, eagle+phrases: the longest proposal the head makes; a lookup's may be "
                             "--max-draft-tokens long")
    parser.add_argument("--token-trees", action=argparse.BooleanOptionalAction, default=True,
                        help="phrases: guess a token tree (the likeliest branches of the phrases and prompt lookup, "
                             "verified in one step); --no-token-trees: one chain")
    parser.add_argument("--ngram-min", type=int, default=2)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--draft-top-k", type=int, default=32)
    add_process_arguments(parser)


def from_arguments(args: argparse.Namespace) -> DraftConfig:
    for name in ("max_draft_tokens", "head_draft_tokens", "ngram_min", "max_model_len", "num_seqs", "draft_top_k"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    check_process_arguments(args)
    if args.ngram_max < args.ngram_min:
        raise ValueError(f"--ngram-max ({args.ngram_max}) is below --ngram-min ({args.ngram_min})")
    kind = args.proposer.split(":", 1)[0]
    if kind not in ("ngram", "model", *DISTILLED_KINDS, "random", "replay") or (kind != "ngram") != (":" in args.proposer):
        raise ValueError(f"--proposer {args.proposer!r}: {PROPOSER_HELP}")
    if kind == "random" and not args.proposer.split(":", 1)[1].isdigit():
        raise ValueError(f"--proposer {args.proposer!r}: random needs the vocabulary size, e.g. random:49152")
    if kind in DISTILLED_KINDS and args.target_model is None:
        raise ValueError(f"--proposer {kind}:PATH needs --target-model (the target's folder: the draft is checked against it)")
    return DraftConfig(
        worker_id=args.worker_id, scheduler_address=args.scheduler_address, proposer=args.proposer,
        target_model=args.target_model,
        max_draft_tokens=args.max_draft_tokens, head_draft_tokens=args.head_draft_tokens, token_trees=args.token_trees,
        ngram_min=args.ngram_min, ngram_max=args.ngram_max,
        max_model_len=args.max_model_len, num_seqs=args.num_seqs, device=args.device, dtype=args.dtype,
        draft_top_k=args.draft_top_k, heartbeat_interval_s=args.heartbeat_interval_s,
        phase_timeout_s=args.phase_timeout_s, step_timeout_s=args.step_timeout_s, drain_timeout_s=args.drain_timeout_s, num_threads=args.num_threads,
        status_file=args.status_file,
    )
