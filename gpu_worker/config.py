"""The worker's frozen configuration, parsed and validated once at the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common.arguments import below_problem
from common import process_config
from common.process_config import ProcessConfig
from modeling.engine import DTYPES


@dataclass(frozen=True)
class WorkerConfig:
    process: ProcessConfig  # id, scheduler address, device, dtype, deadlines, threads, status file
    model: Path
    max_model_len: int  # positions per KV slot
    num_kv_slots: int  # sequences held at once
    max_num_batched_tokens: int  # the largest prefill chunk the scheduler will send
    max_draft_tokens: int  # the longest proposal a verify step carries


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face Llama-family folder")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-kv-slots", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-draft-tokens", type=int, default=8)
    process_config.add_arguments(parser, default_worker_id="worker-0", dtypes=DTYPES)


def from_arguments(args: argparse.Namespace) -> WorkerConfig:
    if problem := below_problem(args, ("max_model_len", "num_kv_slots", "max_num_batched_tokens"), 1):
        raise ValueError(problem)
    return WorkerConfig(
        process=process_config.from_arguments(args),
        model=args.model,
        max_model_len=args.max_model_len,
        num_kv_slots=args.num_kv_slots,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_draft_tokens=args.max_draft_tokens,
    )
