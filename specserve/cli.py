"""`specserve up | generate | scheduler | worker | gateway | prepare-model | keys`: the one command users run."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SERVICE_MODULES = {"scheduler": "scheduler", "worker": "gpu_worker", "draft": "draft_service", "gateway": "gateway"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in SERVICE_MODULES:
        # `specserve worker ARGS` is `python -m gpu_worker ARGS`: one process, nothing in between.
        module = SERVICE_MODULES[argv[0]]
        os.execv(sys.executable, [sys.executable, "-m", module, *argv[1:]])
    if argv and argv[0] == "healthcheck":
        # Run every few seconds in each container: parsed alone, without the imports the other commands need.
        health = argparse.ArgumentParser(prog="specserve healthcheck")
        _add_healthcheck_arguments(health)
        return _run_healthcheck(health.parse_args(argv[1:]))
    parser = _build_parser()
    args = parser.parse_args(argv)
    result: int = args.run(args)
    return result


def _build_parser() -> argparse.ArgumentParser:
    from specserve.client import add_generate_arguments, run_generate
    from specserve.up import add_up_arguments

    parser = argparse.ArgumentParser(prog="specserve", description="LLM serving with speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up = commands.add_parser("up", help="start every service locally and supervise them")
    add_up_arguments(up)
    up.set_defaults(run=_run_up)
    generate = commands.add_parser("generate", help="generate text through a running stack's gRPC API")
    add_generate_arguments(generate)
    generate.set_defaults(run=run_generate)
    distill = commands.add_parser(
        "distill", help="make a draft for a target from the target's own outputs: its phrases and an EAGLE-style head"
    )
    _add_distill_arguments(distill)
    distill.set_defaults(run=_run_distill)
    prepare = commands.add_parser(
        "prepare-model", help="fetch and convert a model once (default: the embedded default) and print its folder"
    )
    prepare.add_argument("model", nargs="?", default=None, help="a named model (gemma3-270m, ...) or a .gguf file")
    prepare.set_defaults(run=_run_prepare_model)
    keys = commands.add_parser(
        "keys",
        help="make the CurveZMQ key folder the services authenticate each other with (what is there already is kept)",
    )
    keys.add_argument("folder", type=Path)
    keys.set_defaults(run=_run_keys)
    health = commands.add_parser("healthcheck", help="exit 0 when a service is ready (for container health checks)")
    _add_healthcheck_arguments(health)
    for name, module in SERVICE_MODULES.items():
        commands.add_parser(name, help=f"run one {name} process (`python -m {module} --help`)", add_help=False)
    return parser


def _add_healthcheck_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT", help="a gateway: its gRPC health is SERVING")
    target.add_argument("--ready", metavar="HOST:PORT", help="a gateway: its HTTP port's /ready says 200")
    target.add_argument(
        "--status-file",
        type=Path,
        help="a worker or the draft service: its status file says READY, written by a process that is "
        "still alive; the scheduler: LISTENING",
    )
    parser.add_argument(
        "--tls-certfile",
        default="",
        help="with --ready: the certificate the gateway serves its ports with, if any (then /ready is "
        "asked over HTTPS); empty: plain HTTP",
    )
    parser.set_defaults(run=_run_healthcheck)


def _add_distill_arguments(parser: argparse.ArgumentParser) -> None:
    from distill.arguments import add_arguments

    add_arguments(parser)
    parser.set_defaults(parser=parser)


def _run_distill(args: argparse.Namespace) -> int:
    from distill.arguments import check_arguments
    from distill.checkpoints import ResumeMismatch
    from distill.train import run

    try:
        run(check_arguments(args.parser, args))
    except ResumeMismatch as error:
        print(f"specserve distill --resume: {error}", file=sys.stderr)
        return 2
    return 0


def _run_prepare_model(args: argparse.Namespace) -> int:
    from specserve.up import UpRefused, resolve_model

    try:
        print(resolve_model(args.model))
    except UpRefused as refused:
        print(f"specserve prepare-model: {refused}", file=sys.stderr)
        return 2
    return 0


def _run_keys(args: argparse.Namespace) -> int:
    from common.transport import make_keys

    made = make_keys(args.folder)
    for path in made:
        print(f"made {path}")
    if not made:
        print(f"{args.folder}: every key is there already; nothing made")
    return 0


def _run_healthcheck(args: argparse.Namespace) -> int:
    from common.status_file import HEALTHY, read_status_file

    if args.status_file is not None:
        state = read_status_file(args.status_file)
        print(state or "no status from a live process")
        return 0 if state in HEALTHY else 1
    from specserve.health_probes import is_ready, is_serving

    if args.ready is not None:
        host, _, port = args.ready.rpartition(":")
        serving = is_ready(host, int(port), tls=bool(args.tls_certfile))
    else:
        host, _, port = args.grpc.rpartition(":")
        serving = is_serving(host, int(port))
    print("SERVING" if serving else "NOT_SERVING")
    return 0 if serving else 1


def _run_up(args: argparse.Namespace) -> int:
    from common import logs
    from specserve.up import UpRefused, up_config
    from specserve.up_run import run_up

    logs.configure("supervisor", json_logs=args.log_json or None)
    try:
        config = up_config(args)
    except UpRefused as refusal:
        raise SystemExit(f"specserve up: {refusal}") from refusal
    return run_up(config)


if __name__ == "__main__":
    sys.exit(main())
