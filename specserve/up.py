"""`specserve up`'s flags, resolved once into a frozen UpConfig; what cannot work is refused before anything starts.

Its flags come from the settings table (common/settings). What `up` must show or check before
anything starts (the model, max_model_len, the draft, the device, the dtype and quantization,
decided as the services decide them) is resolved in `up_config`, and anything that cannot work is
refused there. The rest (speculation's caps, say) each service decides for itself, as it does
started by compose or by hand. The --draft choice is read in draft_choice.py; the config is run
by up_run.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from common.cpus import usable_cpus
from common import settings
from common.defaults import MAX_MODEL_LEN
from common.draft_spec import LOOKUP_THEN_HEAD_KINDS, DraftKind, DraftSpec
from common.transport import ROLES, TransportError, check_keys
from common.settings.choices import AUTO
from gateway.access import ENV_VAR as API_KEY_ENV_VAR
from gateway.access import ApiKeyError, api_keys
from specserve.draft_choice import default_draft, draft_problem, parse_draft
from specserve.stack import StackConfig

GATEWAY_SHUTDOWN_GRACE_S = 25.0  # within the supervisor's 30 s for each process


@dataclass(frozen=True)
class UpConfig:
    stack: StackConfig
    draft_name: str  # --draft as given, or as chosen for the model
    ready_timeout_s: float  # the stack must serve within this, or `up` stops it and exits 1


class UpRefused(ValueError):
    """What `up` cannot run, found before any process starts; the message names the flag."""


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, "up")


def up_config(args: argparse.Namespace) -> UpConfig:
    """`up`'s flags with every default decided; raises UpRefused for what cannot work. `args` is left as it is."""
    from modeling.model.engine import default_dtype  # here: the CLI starts without torch

    if problem := _numbers_problem(args) or _keys_problem(args) or _api_keys_problem(args):
        raise UpRefused(problem)
    try:
        given_draft = None if args.draft is None else parse_draft(args.draft)
    except argparse.ArgumentTypeError as exc:
        raise UpRefused(f"--draft: {exc}") from exc
    model = resolve_model(args.model)
    max_model_len = _max_model_len(args.max_model_len, model)
    _check_weights(model)
    draft = given_draft or default_draft(model)
    proposer = draft.proposer
    if args.head_draft_tokens is not None and (
        args.head_draft_tokens < 1 or proposer is None or not proposer.lookup_then_head
    ):
        raise UpRefused(
            f"--head-draft-tokens must be at least 1, with --draft "
            f"{' or '.join(f'{kind}:PATH' for kind in LOOKUP_THEN_HEAD_KINDS)}"
        )
    if not args.token_trees and (proposer is None or not proposer.proposes_trees):
        raise UpRefused(
            "--no-token-trees goes with --draft default or phrases:PATH (the drafts that propose token trees)"
        )
    if proposer is not None and (problem := draft_problem(proposer, model)):
        raise UpRefused(f"--draft {draft.name}: {problem}")
    device = args.device or _default_device()
    if problem := _device_problem(device, args.num_workers):
        raise UpRefused(f"--device {device}: {problem}")
    dtype = default_dtype(device) if args.dtype == AUTO else args.dtype
    quantization = _quantization(args.quantization, "--quantization", model, device, dtype)
    draft_model = proposer.path if proposer is not None and proposer.kind is DraftKind.MODEL else None
    draft_quantization = (
        _quantization(args.draft_quantization, "--draft-quantization", draft_model, device, dtype)
        if draft_model is not None
        else "none"
    )
    config = stack_config(args, model=model, max_model_len=max_model_len, draft=proposer, device=device, dtype=dtype)
    return UpConfig(
        stack=replace(config, quantization=quantization, draft_quantization=draft_quantization),
        draft_name=draft.name,
        ready_timeout_s=args.ready_timeout_s,
    )


def _quantization(chosen: str, flag: str, model: Path, device: str, dtype: str) -> str:
    """The quantization `chosen` names for `model` ("auto" decided); raises UpRefused for one it cannot take."""
    from modeling.kernels.blocks import QuantizationError, auto_quantization, weight_blocks

    if chosen == "auto":
        return auto_quantization(model, device, dtype)
    try:
        weight_blocks(model, chosen)
    except QuantizationError as exc:
        raise UpRefused(f"{flag} {exc}") from exc
    if chosen != "none" and device != "cpu":
        raise UpRefused(
            f"{flag} {chosen} is served by the CPU kernels, not on --device {device}: the choice there is none"
        )
    return chosen


def stack_config(
    args: argparse.Namespace, *, model: Path, max_model_len: int, draft: DraftSpec | None, device: str, dtype: str
) -> StackConfig:
    """The stack `up`'s flags describe, given what `up_config` found for the model, the draft and the machine."""
    return StackConfig(
        model=model,
        dtype=dtype,
        device=device,
        num_workers=args.num_workers,
        kv_cache_memory_gib=args.kv_cache_memory,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        # Several workers on one CPU share its cores; one alone takes the cores it may use (its own default).
        num_threads_per_worker=(max(1, usable_cpus() // args.num_workers) if args.num_workers > 1 else None)
        if device == "cpu"
        else 0,
        draft=draft,
        head_draft_tokens=args.head_draft_tokens,
        token_trees=args.token_trees,
        suffix_cache_tokens=args.suffix_cache_tokens,
        suffix_scope=args.suffix_scope,
        max_num_seqs=args.max_num_seqs,
        prefix_cache=args.prefix_cache,
        prefix_cache_scope=args.prefix_cache_scope,
        # Unless given, the scheduler decides these from the draft service's hello, as it does started any other way.
        num_speculative_tokens=args.num_speculative_tokens,
        spec_disable_batch_threshold=args.spec_disable_batch_threshold,
        spec_draft_token_budget=args.spec_draft_token_budget,
        gateway_shutdown_grace_s=GATEWAY_SHUTDOWN_GRACE_S,
        speculation_policy=args.speculation_policy,
        require_batch_invariance=args.require_batch_invariance,
        cuda_graphs=args.cuda_graphs,
        scheduling_policy=args.scheduling_policy,
        host=args.host,
        grpc_port=args.port,
        http_port=args.http_port,
        log_json=args.log_json,
        keys=args.keys,
        insecure_loopback=args.insecure_loopback,
        api_key_file=args.api_key_file,
        reasoning_parser=args.reasoning_parser,
        chat_template=args.chat_template,
        tool_call_parser=args.tool_call_parser,
        tls_certfile=args.tls_certfile,
        tls_keyfile=args.tls_keyfile,
        tls_ca_certfile=args.tls_ca_certfile,
        allowed_origins=args.allowed_origins,
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
        return (
            f"--prefix-cache-scope tenant: tenants are told apart by their API keys, and none is given "
            f"(--api-key-file or {API_KEY_ENV_VAR})"
        )
    return ""


def _numbers_problem(args: argparse.Namespace) -> str:
    """What is wrong with `up`'s own numbers ("" when nothing)."""
    at_least = {
        "--num-workers": (args.num_workers, 1),
        "--max-model-len": (1 if args.max_model_len is None else args.max_model_len, 1),
        "--max-num-seqs": (args.max_num_seqs, 1),
        "--max-num-batched-tokens": (args.max_num_batched_tokens, 1),
        "--spec-draft-token-budget": (args.spec_draft_token_budget, 0),
        "--ready-timeout-s": (args.ready_timeout_s, 0),
    }
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
    from modeling.gguf.convert import GgufConversionError
    from modeling.model.store import DEFAULT_MODEL_NAME, MODEL_NAMES, ModelFetchError, ensure_gguf_model, ensure_model

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
    from modeling.model.weights import WeightError, WeightFiles

    try:
        WeightFiles(model)
    except WeightError as exc:
        raise UpRefused(f"--model {model}: {exc}") from exc


def _max_model_len(given: int | None, model: Path) -> int:
    """--max-model-len, or MAX_MODEL_LEN or the model's positions when fewer."""
    from modeling.model.config import ModelConfig, UnsupportedModel

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
