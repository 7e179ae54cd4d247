"""The worker's frozen configuration, parsed and validated once at the command line."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from common import process_config, settings
from common.arguments import below_problem, not_positive_problem
from common.process_config import ProcessConfig
from common.settings.choices import AUTO
from modeling.model.engine import default_dtype
from modeling.kernels.blocks import QuantizationError, auto_quantization, weight_blocks


GRAPH_BACKEND_ENV = "SPECSERVE_GRAPH_BACKEND"  # "recording": graphs on a CPU, through the recording backend (tests)
RECORDING = "recording"


@dataclass(frozen=True)
class WorkerConfig:
    process: ProcessConfig  # id, scheduler address, device, dtype, deadlines, threads, status file
    model: Path
    max_model_len: int  # positions per sequence at most
    kv_cache_memory_gib: float | None  # the KV cache's budget; None: the default share (--kv-cache-memory's help)
    page_size: int  # positions per KV page
    max_num_seqs: int  # sequences in one step at most (warm-up runs that many)
    max_num_batched_tokens: int  # the largest prefill chunk the scheduler will send
    max_draft_tokens: int  # the longest proposal a verify step carries
    quantization: str = "none"  # GGUF blocks served as they are (modeling/kernels/blocks.py), or "none"
    # Serve without drafts where the steps are not batch invariant (greedy answers then always equal plain
    # decoding's, bit for bit); else such a worker verifies as GPU engines do, lossless in distribution.
    require_batch_invariance: bool = False
    # Decode and verify steps from captured graphs (modeling/model/graphs.py): "on" (a failed capture fails the
    # worker), "fallback" (it serves eagerly instead), "off".
    cuda_graphs: str = "off"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, "worker")


def _chosen(args: argparse.Namespace) -> argparse.Namespace:
    """args with --dtype auto and --quantization auto decided for this model on this device (`specserve up` decides
    them alike, to show them and refuse what cannot work before anything starts)."""
    dtype = default_dtype(args.device) if args.dtype == AUTO else args.dtype
    quantization = args.quantization
    if quantization == AUTO:
        quantization = auto_quantization(args.model, args.device, dtype)
    graphs = args.cuda_graphs
    if graphs == AUTO:
        graphs = "on" if args.device.startswith("cuda") else "off"
    return argparse.Namespace(**{**vars(args), "dtype": dtype, "quantization": quantization, "cuda_graphs": graphs})


def from_arguments(args: argparse.Namespace) -> WorkerConfig:
    """Raises ValueError naming the setting (a quantization the model cannot take among them)."""
    args = _chosen(args)
    try:
        weight_blocks(args.model, args.quantization)
    except QuantizationError as exc:
        raise ValueError(f"--quantization {exc}") from exc
    if problem := below_problem(args, ("max_model_len", "page_size", "max_num_seqs", "max_num_batched_tokens"), 1):
        raise ValueError(problem)
    if args.kv_cache_memory is not None and (problem := not_positive_problem(args, ("kv_cache_memory",))):
        raise ValueError(problem)
    if args.cuda_graphs != "off" and not args.device.startswith("cuda") and graph_backend_name() != RECORDING:
        raise ValueError(f"--cuda-graphs {args.cuda_graphs} needs a CUDA device (--device cuda:N), not {args.device}")
    return WorkerConfig(
        process=process_config.from_arguments(args),
        model=args.model,
        max_model_len=args.max_model_len,
        kv_cache_memory_gib=args.kv_cache_memory,
        page_size=args.page_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_draft_tokens=args.max_draft_tokens,
        quantization=args.quantization,
        require_batch_invariance=args.require_batch_invariance,
        cuda_graphs=args.cuda_graphs,
    )


def graph_backend_name() -> str:
    """GRAPH_BACKEND_ENV's value: "recording" lets a worker on a CPU capture and replay through the recording backend
    (modeling/model/graphs.py), for tests and the device check's dry run."""
    return os.environ.get(GRAPH_BACKEND_ENV, "")
