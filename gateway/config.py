"""The gateway's settings: one frozen object built from the command line and checked there."""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.transport import Transport, TransportError
from common.transport import from_arguments as transport_from_arguments
from common import settings
from common.arguments import flag, not_positive_problem
from gateway.access import ENV_VAR as API_KEY_ENV_VAR
from gateway.access import ApiKeyError, ApiKeys, api_keys
from gateway.cache_scope import CacheScope
from gateway.cors import Cors, OriginError
from gateway.http_body import HTTP_MAX_BODY_BYTES, HTTP_READ_TIMEOUT_S
from gateway.output_formats import ReasoningParser, ToolCallParser
from gateway.tls import Tls, TlsError


@dataclass(frozen=True)
class GatewayConfig:
    model_dir: Path  # holds tokenizer.json, tokenizer_config.json, config.json
    scheduler_address: str  # ZeroMQ endpoint of the scheduler's gateway ROUTER
    host: str
    port: int  # 0: any free port (the chosen one is logged)
    log_json: bool
    gateway_id: str
    http_port: int = 8000  # the OpenAI-compatible HTTP API; 0: any free port (logged)
    scheduler_timeout_s: float = 2.0  # an info query unanswered this long means the scheduler is unreachable
    # A request in flight waits this long for a scheduler that stopped answering to come back (restarted by its
    # supervisor) and resumes there; only then does it fail UNAVAILABLE.
    scheduler_restart_window_s: float = 60.0
    health_poll_interval_s: float = 0.5
    shutdown_grace_s: float = 30.0  # streams in flight get this long to finish after the first SIGTERM/SIGINT
    http_max_body_bytes: int = HTTP_MAX_BODY_BYTES  # a larger HTTP body gets 413
    http_read_timeout_s: float = HTTP_READ_TIMEOUT_S  # an HTTP body not all received by then gets 408
    transport: Transport = Transport(None)  # its keys (common/transport.py), or insecure loopback
    prefix_cache_scope: CacheScope = "global"  # which requests share prefix-cache pages (gateway/cache_scope.py)
    api_keys: ApiKeys = ApiKeys()  # the keys callers present (gateway/access.py); none: the ports are open
    tls: Tls | None = None  # the public ports' certificate (gateway/tls.py); None: plain TCP
    chat_template: Path | None = None  # a Jinja chat template of one's own, in place of the model's
    reasoning_parser: ReasoningParser | None = None  # a thinking model's reasoning apart (gateway/reasoning.py)
    tool_call_parser: ToolCallParser | None = None  # the format the model writes tool calls in (gateway/tools.py)
    cors: Cors = Cors()  # the origins whose scripts may read HTTP answers (gateway/cors.py); none: no CORS headers


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gateway", description="specserve gateway: the public gRPC API in front of the scheduler."
    )
    settings.add_arguments(parser, "gateway")
    return parser


def parse_config(argv: Sequence[str] | None = None) -> GatewayConfig:
    """The config from the command line; exits with a usage error (status 2) on a bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.model / "tokenizer.json").is_file():
        parser.error(f"--model {args.model}: no tokenizer.json there")
    for name in ("port", "http_port"):
        if not 0 <= getattr(args, name) <= 65535:
            parser.error(f"{flag(name)} {getattr(args, name)}: must be in [0, 65535]")
    if problem := not_positive_problem(
        args,
        (
            "scheduler_timeout_s",
            "scheduler_restart_window_s",
            "health_poll_interval_s",
            "shutdown_grace_s",
            "http_max_body_bytes",
            "http_read_timeout_s",
        ),
    ):
        parser.error(problem)
    try:
        keys = api_keys(args.api_key, args.api_key_file)
    except ApiKeyError as error:
        parser.error(str(error))
    try:
        cors = Cors.of(args.allowed_origins)
    except OriginError as error:
        parser.error(str(error))
    try:
        tls = Tls.load(args.tls_certfile, args.tls_keyfile, args.tls_ca_certfile)
    except TlsError as error:
        parser.error(str(error))
    if args.prefix_cache_scope == "tenant" and not keys.required:
        parser.error(
            f"--prefix-cache-scope tenant: tenants are told apart by their API keys, and none is given "
            f"(--api-key, --api-key-file or {API_KEY_ENV_VAR})"
        )
    try:
        secured = transport_from_arguments(args, "gateway", (("--scheduler-address", args.scheduler_address),))
    except TransportError as exc:
        parser.error(str(exc))
    return GatewayConfig(
        model_dir=args.model,
        scheduler_address=args.scheduler_address,
        host=args.host,
        port=args.port,
        http_port=args.http_port,
        log_json=args.log_json,
        gateway_id=args.gateway_id or f"gateway-{uuid.uuid4().hex[:12]}",
        scheduler_timeout_s=args.scheduler_timeout_s,
        scheduler_restart_window_s=args.scheduler_restart_window_s,
        health_poll_interval_s=args.health_poll_interval_s,
        shutdown_grace_s=args.shutdown_grace_s,
        http_max_body_bytes=args.http_max_body_bytes,
        http_read_timeout_s=args.http_read_timeout_s,
        transport=secured,
        prefix_cache_scope=args.prefix_cache_scope,
        api_keys=keys,
        tls=tls,
        cors=cors,
        chat_template=args.chat_template,
        reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
    )
