"""The gateway's settings: one frozen object built from the command line and checked there."""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.transport import Transport, TransportError
from common.transport import add_arguments as add_transport_arguments
from common.transport import from_arguments as transport_from_arguments
from common.arguments import flag, not_positive_problem
from gateway.access import ENV_VAR as API_KEY_ENV_VAR
from gateway.access import ApiKeyError, ApiKeys, api_keys
from gateway.cache_scope import SCOPES, CacheScope
from gateway.cors import Cors, OriginError
from gateway.http_body import DEFAULT_MAX_BODY_BYTES, DEFAULT_READ_TIMEOUT_S
from gateway.output_formats import ReasoningParser, ToolCallParser
from gateway.output_formats import add_arguments as add_output_format_arguments
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
    http_max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger HTTP body gets 413
    http_read_timeout_s: float = DEFAULT_READ_TIMEOUT_S  # an HTTP body not all received by then gets 408
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
    parser.add_argument("--model", required=True, type=Path, help="model folder with tokenizer.json and config.json")
    parser.add_argument("--scheduler-address", default="tcp://127.0.0.1:5555", help="the scheduler's gateway endpoint")
    add_output_format_arguments(parser)
    parser.add_argument("--host", default="0.0.0.0", help="address the gRPC server listens on")
    parser.add_argument("--port", type=int, default=50051, help="gRPC port; 0 picks a free one")
    parser.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP port; 0 picks a free one")
    parser.add_argument("--log-json", action="store_true", help="log JSON lines instead of console text")
    parser.add_argument("--gateway-id", default=None, help="this gateway's name at the scheduler (default: random)")
    parser.add_argument("--scheduler-timeout-s", type=float, default=2.0, help="wait for a scheduler answer")
    parser.add_argument("--scheduler-restart-window-s", type=float, default=60.0,
                        help="how long a request in flight waits for a silent scheduler to come back before it fails")
    parser.add_argument("--health-poll-interval-s", type=float, default=0.5, help="how often health asks the scheduler")
    parser.add_argument("--shutdown-grace-s", type=float, default=30.0, help="time streams get to finish on shutdown")
    parser.add_argument("--http-max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help="the largest HTTP request body accepted (larger: 413)")
    parser.add_argument("--http-read-timeout-s", type=float, default=DEFAULT_READ_TIMEOUT_S,
                        help="how long an HTTP request body may take to arrive (longer: 408 and the connection closes)")
    parser.add_argument("--prefix-cache-scope", choices=SCOPES, default="global",
                        help="which requests share prefix-cache pages: global (every request without a cache_salt; "
                             "anyone who can reach the ports can probe what others sent), salt (only requests with "
                             "the same cache_salt), tenant (only requests made with the same API key; needs keys)")
    parser.add_argument("--api-key", action="append", default=[],
                        help="a key callers must present (HTTP: Authorization: Bearer KEY; gRPC: the same metadata); "
                             "repeat for more, each a tenant. /health and /ready stay open. Visible to anyone who can "
                             f"list processes: prefer --api-key-file or {API_KEY_ENV_VAR}")
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help="a file of keys callers may present, one a line (# starts a comment)")
    # An empty value is no file: docker-compose.yml passes its settings through whether or not they are set.
    parser.add_argument("--tls-certfile", type=path_or_none, default=None,
                        help="PEM certificate (chain) both public ports serve TLS with; needs --tls-keyfile")
    parser.add_argument("--tls-keyfile", type=path_or_none, default=None, help="the certificate's PEM private key")
    parser.add_argument("--tls-ca-certfile", type=path_or_none, default=None,
                        help="PEM CA certificates: clients must then present a certificate one of them signed (mTLS; "
                             "/health and /ready stay open on the HTTP port)")
    parser.add_argument("--allowed-origins", action="append", default=[],
                        help="origins (scheme://host[:port], comma-separated or repeated; * for any) whose scripts "
                             "may call the HTTP API from a browser (CORS); none by default")
    add_transport_arguments(parser)
    return parser


def path_or_none(value: str) -> Path | None:
    """A file flag's value: "" is none."""
    return Path(value) if value else None


def parse_config(argv: Sequence[str] | None = None) -> GatewayConfig:
    """The config from the command line; exits with a usage error (status 2) on a bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.model / "tokenizer.json").is_file():
        parser.error(f"--model {args.model}: no tokenizer.json there")
    for name in ("port", "http_port"):
        if not 0 <= getattr(args, name) <= 65535:
            parser.error(f"{flag(name)} {getattr(args, name)}: must be in [0, 65535]")
    if problem := not_positive_problem(args, ("scheduler_timeout_s", "scheduler_restart_window_s",
                                              "health_poll_interval_s", "shutdown_grace_s", "http_max_body_bytes",
                                              "http_read_timeout_s")):
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
        parser.error(f"--prefix-cache-scope tenant: tenants are told apart by their API keys, and none is given "
                     f"(--api-key, --api-key-file or {API_KEY_ENV_VAR})")
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
