"""`specserve up | generate | scheduler | worker | gateway | prepare-model`: the one command users run."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

from common import logs
from draft_service.defaults import DISTILLED_KINDS, HEAD_DRAFT_TOKENS, LOOKUP_THEN_HEAD_KINDS, MODEL_KINDS
from specserve.supervisor import GaveUp, RestartPolicy, ServiceSpec, Supervisor

SERVICE_MODULES = {"scheduler": "scheduler", "worker": "gpu_worker", "draft": "draft_service", "gateway": "gateway"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICE_MODULES:
        # `specserve worker ARGS` is `python -m gpu_worker ARGS`: one process, nothing in between.
        module = SERVICE_MODULES[argv[0]]
        os.execv(sys.executable, [sys.executable, "-m", module, *argv[1:]])
    parser = _build_parser()
    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


def _build_parser() -> argparse.ArgumentParser:
    from specserve.client import add_generate_arguments, run_generate

    parser = argparse.ArgumentParser(prog="specserve", description="LLM serving with speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = commands.add_parser("up", help="start every service locally and supervise them")
    _add_up_arguments(up)
    up.set_defaults(run=_run_up)
    generate = commands.add_parser("generate", help="generate text through a running stack's gRPC API")
    add_generate_arguments(generate)
    generate.set_defaults(run=run_generate)
    distill = commands.add_parser("distill", help="make a draft for a target from the target's own outputs: its phrases and an EAGLE-style head")
    _add_distill_arguments(distill)
    distill.set_defaults(run=_run_distill)
    prepare = commands.add_parser("prepare-model", help="convert the embedded default model once and print its folder")
    prepare.set_defaults(run=_run_prepare_model)
    health = commands.add_parser("healthcheck", help="exit 0 when a service is ready (for container health checks)")
    target = health.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT", help="a gateway: its gRPC health is SERVING")
    target.add_argument("--status-file", type=Path, help="a worker or scheduler: its status file says READY")
    health.set_defaults(run=_run_healthcheck)
    for name, module in SERVICE_MODULES.items():
        commands.add_parser(name, help=f"run one {name} process (`python -m {module} --help`)", add_help=False)
    return parser


def _add_up_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="a local Hugging Face Llama-family folder (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: the faster one on this machine")
    parser.add_argument("--num-workers", type=int, default=1, help="data-parallel target worker processes")
    parser.add_argument("--device", default=None, help="cpu, or cuda (one worker per GPU); default: cuda when present")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="the gRPC port")
    parser.add_argument("--http-port", type=int, default=8000, help="the OpenAI-compatible HTTP port")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="tokens per sequence at most (default: 2048, or the model's positions when fewer)")
    parser.add_argument("--num-kv-slots", type=int, default=64, help="sequences each worker holds at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--draft", default=None, type=_draft_choice,
                        help="the draft service's proposer: none (no speculation), ngram (prompt lookup), default (prompt "
                             "lookup, then the embedded default model's own phrases shipped in drafts/; used unless told, "
                             "with ngram for any other model), phrases:PATH (prompt lookup, then the phrases in a folder "
                             "made by `specserve distill` for --model), eagle:PATH (the EAGLE head in such a folder), "
                             "eagle+ngram:PATH (prompt lookup, else the folder's head), eagle+phrases:PATH (prompt lookup, "
                             "then the folder's phrases, else its head), or model:PATH "
                             "(a draft model folder whose vocabulary matches the target's)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help=f"draft tokens per sequence in a speculative step (default: {HEAD_DRAFT_TOKENS} for a draft head "
                             "alone, else 6)")
    parser.add_argument("--head-draft-tokens", type=int, default=None,
                        help=f"eagle+ngram and eagle+phrases: the longest proposal the head makes where no lookup matches "
                             f"(default: the draft service's, {HEAD_DRAFT_TOKENS}; a lookup's may reach the whole k)")
    parser.add_argument("--no-token-trees", action="store_true",
                        help="default and phrases:PATH: propose one chain, not a token tree of guesses")
    parser.add_argument("--spec-disable-batch-threshold", type=int, default=None,
                        help="speculate only when a step has at most this many sequences (default: 16 for prompt lookup "
                             "and phrases, 4 for a draft that runs a model: measured in docs/benchmarks.md)")
    parser.add_argument("--spec-draft-token-budget", type=int, default=32,
                        help="draft tokens a speculative step verifies in all, shared evenly among its sequences")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument("--log-json", action="store_true")


def _draft_choice(value: str) -> str:
    kind, _, path = value.partition(":")
    if value in ("none", "ngram", "default") or (kind in ("model", *DISTILLED_KINDS) and path):
        return value
    raise argparse.ArgumentTypeError(
        f"expected none, ngram, default, phrases:PATH, eagle:PATH, eagle+ngram:PATH, eagle+phrases:PATH or model:PATH, "
        f"got {value!r}")


def _default_draft(model: Path) -> str:
    """The shipped draft when it was trained for `model` (the embedded default), else prompt lookup."""
    from modeling.eagle import DraftMismatch, check_target
    from modeling.model_store import default_draft_dir

    try:
        check_target(default_draft_dir(), model)
    except (DraftMismatch, OSError):  # another model, or an install without the repository's drafts/ folder
        return "ngram"
    return "default"


def _default_spec_threshold(proposer: str) -> int:
    """Lookups cost the draft nothing and pay up to 16 sequences a step (with k shrinking); drafts that run a model, to 4."""
    return 4 if proposer.partition(":")[0] in MODEL_KINDS else 16


def _draft_proposer(draft: str) -> str:
    """The draft service's --proposer for `up --draft` (paths made absolute)."""
    from modeling.model_store import default_draft_dir

    if draft == "default":
        return f"phrases:{default_draft_dir()}"
    kind, _, path = draft.partition(":")
    return f"{kind}:{Path(path).resolve()}" if path else draft


def _add_distill_arguments(parser: argparse.ArgumentParser) -> None:
    from distill.train import add_arguments

    add_arguments(parser)
    parser.set_defaults(parser=parser)


def _run_distill(args: argparse.Namespace) -> int:
    from distill.train import ResumeMismatch, check_arguments, run

    try:
        run(check_arguments(args.parser, args))
    except ResumeMismatch as error:
        print(f"specserve distill --resume: {error}", file=sys.stderr)
        return 2
    return 0


def _run_prepare_model(args: argparse.Namespace) -> int:
    from modeling.model_store import ensure_default_model

    print(ensure_default_model())
    return 0


def _run_healthcheck(args: argparse.Namespace) -> int:
    from common.status_file import read_status_file

    if args.status_file is not None:
        state = read_status_file(args.status_file)
        print(state or "no status yet")
        return 0 if state == "READY" else 1
    host, _, port = args.grpc.rpartition(":")
    serving = _is_serving(host, int(port))
    print("SERVING" if serving else "NOT_SERVING")
    return 0 if serving else 1


def _run_up(args: argparse.Namespace) -> int:
    from modeling.config import ModelConfig, UnsupportedModel
    from modeling.model_store import ensure_default_model

    logs.configure("supervisor", json_logs=args.log_json or None)
    if problem := _up_arguments_problem(args):
        raise SystemExit(f"specserve up: {problem}")
    model = args.model or ensure_default_model()
    if not (model / "config.json").is_file():
        raise SystemExit(f"specserve up: --model {model} has no config.json")
    try:
        positions = ModelConfig.from_folder(model).max_position_embeddings
    except UnsupportedModel as exc:
        raise SystemExit(f"specserve up: --model {model}: {exc}") from exc
    if args.max_model_len is None:
        args.max_model_len = min(2048, positions)
    elif args.max_model_len > positions:
        raise SystemExit(f"specserve up: --max-model-len {args.max_model_len} exceeds the model's {positions} positions")
    if args.draft is None:
        args.draft = _default_draft(model)
    proposer = _draft_proposer(args.draft)
    if args.head_draft_tokens is not None and (args.head_draft_tokens < 1
                                               or proposer.partition(":")[0] not in LOOKUP_THEN_HEAD_KINDS):
        raise SystemExit(f"specserve up: --head-draft-tokens must be at least 1, with --draft "
                         f"{' or '.join(f'{kind}:PATH' for kind in LOOKUP_THEN_HEAD_KINDS)}")
    if args.no_token_trees and proposer.partition(":")[0] != "phrases":
        raise SystemExit("specserve up: --no-token-trees goes with --draft default or phrases:PATH (the drafts that "
                         "propose token trees)")
    if args.num_speculative_tokens is None:
        # A head's later proposals are accepted rarely (docs/benchmarks.md); a lookup's long ones often.
        args.num_speculative_tokens = HEAD_DRAFT_TOKENS if proposer.startswith("eagle:") else 6
    if args.spec_disable_batch_threshold is None:
        args.spec_disable_batch_threshold = _default_spec_threshold(proposer)
    if ":" in proposer and not (Path(proposer.partition(":")[2]) / "config.json").is_file():
        raise SystemExit(f"specserve up: --draft {args.draft}: {proposer.partition(':')[2]} has no config.json")
    if problem := _draft_problem(proposer, model):
        raise SystemExit(f"specserve up: --draft {args.draft}: {problem}")
    device = args.device or _default_device()
    if problem := _device_problem(device, args.num_workers):
        raise SystemExit(f"specserve up: --device {device}: {problem}")
    dtype = args.dtype or _default_dtype(device)
    supervisor = Supervisor(_service_specs(args, model, device, dtype), RestartPolicy())
    supervisor.install_signal_handlers()
    supervisor.start()
    ready_by = time.monotonic() + args.ready_timeout_s
    try:
        supervisor.watch(until=lambda: _is_serving(args.host, args.port) or time.monotonic() > ready_by)
        if not supervisor.stopping and time.monotonic() > ready_by and not _is_serving(args.host, args.port):
            print(f"specserve up: not serving within {args.ready_timeout_s:g} s (--ready-timeout-s): no target worker "
                  "became READY; see the services' logs; stopping", file=sys.stderr)
            supervisor.stop(grace_s=10.0)
            return 1
        if not supervisor.stopping:
            print(f"specserve ready: gRPC on {args.host}:{args.port}, HTTP on {args.host}:{args.http_port}, model {model.name} ({dtype}, {args.num_workers} worker(s) "
                  f"on {device}), draft {args.draft}", flush=True)
            supervisor.watch()
    except GaveUp as exc:
        print(f"specserve up: {exc}; stopping", file=sys.stderr)
        supervisor.stop(grace_s=10.0)
        return 1
    supervisor.stop(grace_s=30.0)
    return 0


def _up_arguments_problem(args: argparse.Namespace) -> str:
    """What is wrong with `up`'s own numbers ("" when nothing), found before any process starts."""
    at_least = {"--num-workers": (args.num_workers, 1), "--max-model-len": (1 if args.max_model_len is None else args.max_model_len, 1),
                "--num-kv-slots": (args.num_kv_slots, 1), "--max-num-batched-tokens": (args.max_num_batched_tokens, 1),
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
    if args.port == args.http_port:
        return f"--port and --http-port are both {args.port}"
    return ""


def _draft_problem(proposer: str, model: Path) -> str:
    """Why the draft cannot serve this target ("" when it can): one made for another model is refused here, not after
    the stack has started and the draft service has failed its start-up five times."""
    kind, _, path = proposer.partition(":")
    if kind in DISTILLED_KINDS:
        from modeling.eagle import DraftMismatch, check_target

        try:
            check_target(Path(path), model)
        except DraftMismatch as error:
            return str(error)
    if kind == "model":
        from modeling.config import vocab_fingerprint

        if vocab_fingerprint(Path(path)) != vocab_fingerprint(model):
            return f"the draft model's vocabulary differs from --model's ({path})"
    return ""


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


def _service_specs(args: argparse.Namespace, model: Path, device: str, dtype: str) -> list[ServiceSpec]:
    gateway_port, worker_port = _free_port(), _free_port()
    gateway_address, worker_address = f"tcp://127.0.0.1:{gateway_port}", f"tcp://127.0.0.1:{worker_port}"
    log_flag = ["--log-json"] if args.log_json else []
    python = [sys.executable, "-m"]
    specs = [
        ServiceSpec("scheduler", python + ["scheduler", "--gateway-address", gateway_address, "--worker-address", worker_address,
                                           "--model-name", model.name, "--max-model-len", str(args.max_model_len),
                                           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
                                           "--max-num-seqs", str(args.num_kv_slots),
                                           "--num-speculative-tokens", str(args.num_speculative_tokens),
                                           "--spec-disable-batch-threshold", str(args.spec_disable_batch_threshold),
                                           "--spec-draft-token-budget", str(args.spec_draft_token_budget)]
                     + log_flag, stop_order=3),
        ServiceSpec("gateway", python + ["gateway", "--model", str(model), "--scheduler-address", gateway_address,
                                         "--host", args.host, "--port", str(args.port), "--http-port", str(args.http_port),
                                         "--shutdown-grace-s", "25"] + log_flag, stop_order=0),
    ]
    num_threads = max(1, (os.cpu_count() or 1) // args.num_workers) if device == "cpu" else 0
    for i in range(args.num_workers):
        worker_device = f"cuda:{i}" if device == "cuda" else device
        specs.append(ServiceSpec(f"worker-{i}", python + [
            "gpu_worker", "--worker-id", f"worker-{i}", "--model", str(model), "--scheduler-address", worker_address,
            "--device", worker_device, "--dtype", dtype, "--max-model-len", str(args.max_model_len),
            "--num-kv-slots", str(args.num_kv_slots), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--num-threads", str(num_threads)] + log_flag, stop_order=1))
    if args.draft != "none":
        proposer = _draft_proposer(args.draft)
        proposer_args = ["--target-model", str(model)] if proposer.partition(":")[0] in DISTILLED_KINDS else []
        if args.head_draft_tokens is not None:
            proposer_args += ["--head-draft-tokens", str(args.head_draft_tokens)]
        if args.no_token_trees:
            proposer_args.append("--no-token-trees")
        specs.append(ServiceSpec("draft", python + [
            "draft_service", "--worker-id", "draft-0", "--proposer", proposer, *proposer_args, "--scheduler-address", worker_address,
            "--device", "cuda:0" if device == "cuda" else device, "--dtype", dtype, "--max-model-len", str(args.max_model_len),
            "--num-seqs", str(args.num_kv_slots * args.num_workers), "--max-draft-tokens", str(max(args.num_speculative_tokens, 1)),
            "--num-threads", "1" if device == "cpu" else "0"] + log_flag, stop_order=1, essential=False))
    return specs


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _default_dtype(device: str) -> str:
    """bfloat16 where the hardware computes it natively (GPUs, CPUs with AVX512-BF16 or AMX), else float32."""
    import torch

    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported() else "float32"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _is_serving(host: str, port: int) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"
    try:
        with grpc.insecure_channel(target) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
    except grpc.RpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


if __name__ == "__main__":
    sys.exit(main())
