"""The worker's frozen configuration, parsed and validated once at the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common.lifecycle_process import add_process_arguments, check_process_arguments
from modeling.engine import DTYPES


@dataclass(frozen=True)
class WorkerConfig:
    worker_id: str
    model: Path
    scheduler_address: str  # the scheduler's worker socket, e.g. tcp://127.0.0.1:5556
    device: str  # "cpu" or "cuda:N"
    dtype: str
    max_model_len: int  # positions per KV slot
    num_kv_slots: int  # sequences held at once
    max_num_batched_tokens: int  # the largest prefill chunk the scheduler will send
    max_draft_tokens: int  # the longest proposal a verify step carries
    heartbeat_interval_s: float
    phase_timeout_s: float  # a start-up phase running longer ends the process (FAILED)
    step_timeout_s: float  # a step (proposal) running longer ends the process (FAILED)
    drain_timeout_s: float  # after SIGTERM, how long work in flight may take before the process stops anyway
    num_threads: int  # torch intra-op threads on CPU; 0 = torch's default
    status_file: Path | None  # the current lifecycle state is written here (container health checks)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--worker-id", default="worker-0")
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face Llama-family folder")
    parser.add_argument("--scheduler-address", default="tcp://127.0.0.1:5556")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-kv-slots", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-draft-tokens", type=int, default=8)
    add_process_arguments(parser)


def from_arguments(args: argparse.Namespace) -> WorkerConfig:
    for name in ("max_model_len", "num_kv_slots", "max_num_batched_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    check_process_arguments(args)
    return WorkerConfig(
        worker_id=args.worker_id,
        model=args.model,
        scheduler_address=args.scheduler_address,
        device=args.device,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        num_kv_slots=args.num_kv_slots,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_draft_tokens=args.max_draft_tokens,
        heartbeat_interval_s=args.heartbeat_interval_s,
        phase_timeout_s=args.phase_timeout_s, step_timeout_s=args.step_timeout_s, drain_timeout_s=args.drain_timeout_s,
        num_threads=args.num_threads,
        status_file=args.status_file,
    )
