"""The worker's frozen configuration, parsed and validated once at the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from common import process_config
from common.arguments import below_problem, not_positive_problem
from common.defaults import MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from common.process_config import ProcessConfig
from modeling.engine import DTYPES, default_dtype
from modeling.kv_cache import DEFAULT_PAGE_SIZE
from modeling.quantized import QUANTIZATION_HELP, QuantizationError, auto_quantization, weight_blocks

AUTO = "auto"  # --dtype, --quantization: what `specserve up` would choose for the model on this device

KV_MEMORY_HELP = (
    "GiB of memory for the KV cache (keys and values of every page). Default: a quarter of the memory available when "
    "the worker starts on CPU, half the free device memory on CUDA, and never more than --max-num-seqs sequences "
    "of --max-model-len tokens need"
)


@dataclass(frozen=True)
class WorkerConfig:
    process: ProcessConfig  # id, scheduler address, device, dtype, deadlines, threads, status file
    model: Path
    max_model_len: int  # positions per sequence at most
    kv_cache_memory_gib: float | None  # the KV cache's budget; None: the default share (see KV_MEMORY_HELP)
    page_size: int  # positions per KV page
    max_num_seqs: int  # sequences in one step at most (warm-up runs that many)
    max_num_batched_tokens: int  # the largest prefill chunk the scheduler will send
    max_draft_tokens: int  # the longest proposal a verify step carries
    quantization: str = "none"  # GGUF blocks served as they are (modeling/quantized.py), or "none"
    # Serve without drafts where the steps are not batch invariant (greedy answers then always equal plain
    # decoding's, bit for bit); else such a worker verifies as GPU engines do, lossless in distribution.
    require_batch_invariance: bool = False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face Llama-family folder")
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    parser.add_argument("--kv-cache-memory", type=float, default=None, help=KV_MEMORY_HELP)
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help="positions per KV page")
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, help="sequences in one step at most")
    parser.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS)
    parser.add_argument("--max-draft-tokens", type=int, default=8)
    parser.add_argument("--require-batch-invariance", action="store_true",
                        help="serve without speculation where this worker's steps are not batch invariant (torch's ops, "
                             "a GPU), so that greedy answers equal plain decoding's bit for bit; without it such a "
                             "worker verifies drafts losslessly in distribution, as GPU engines do")
    parser.add_argument("--quantization", default="none",
                        help=f"{QUANTIZATION_HELP}; {AUTO}: the model's own GGUF blocks on CPU where its projections "
                             "are all in a format the kernel reads (not the embedded default in bfloat16 on a CPU "
                             "with AMX), else none (what `specserve up` chooses)")
    process_config.add_arguments(parser, default_worker_id="worker-0", dtypes=(*DTYPES, AUTO))


def _chosen(args: argparse.Namespace) -> argparse.Namespace:
    """args with --dtype auto and --quantization auto decided as `specserve up` decides them for this device."""
    dtype = default_dtype(args.device) if args.dtype == AUTO else args.dtype
    quantization = args.quantization
    if quantization == AUTO:
        quantization = auto_quantization(args.model, args.device, dtype)
    return argparse.Namespace(**{**vars(args), "dtype": dtype, "quantization": quantization})


def from_arguments(args: argparse.Namespace) -> WorkerConfig:
    """Raises ValueError naming the setting (a quantization the model cannot take among them)."""
    args = _chosen(args)
    try:
        weight_blocks(args.model, args.quantization)
    except QuantizationError as exc:
        raise ValueError(str(exc)) from exc
    if problem := below_problem(args, ("max_model_len", "page_size", "max_num_seqs", "max_num_batched_tokens"), 1):
        raise ValueError(problem)
    if args.kv_cache_memory is not None and (problem := not_positive_problem(args, ("kv_cache_memory",))):
        raise ValueError(problem)
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
    )
