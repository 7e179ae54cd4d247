"""The one launcher's plan of a stack on this machine:
a scheduler, target workers, a draft service and a gateway, each a process.

A frozen StackConfig says what runs, StackAddresses where it listens (free local ports);
`service_specs` turns them into the command line of every process. `specserve up` runs
those under its supervisor (up_run.py); the end-to-end tests and the benchmarks run them
with LocalStack (local_stack.py).
"""

from __future__ import annotations

import random
import socket
import sys
from collections.abc import Collection
from dataclasses import dataclass, replace
from pathlib import Path

from common import settings
from common.defaults import MAX_MODEL_LEN
from common.draft_spec import DraftSpec
from common.transport import make_keys
from specserve.supervisor import ServiceSpec

DRAFT_ID = "draft-0"
_LOW_PORT = 20000  # free_ports draws from here up to the ephemeral range


def free_ports(count: int, *, taken: Collection[int] = ()) -> list[int]:
    """`count` different TCP ports on 127.0.0.1 that nothing listens on now, none of them in `taken`.

    Each is held bound until all are found, so no two are the same. They are drawn from below the
    kernel's ephemeral range where it has one: the ports it hands to connecting sockets (a worker
    dialing the scheduler) and to binds to port 0 then cannot take one before its server binds it.
    """
    low = _ephemeral_low()
    draws = random.Random()
    held: list[socket.socket] = []
    try:
        while len(held) < count:
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", draws.randrange(_LOW_PORT, low) if low > _LOW_PORT else 0))
            except OSError:
                s.close()
                continue
            if s.getsockname()[1] in taken:
                s.close()
                continue
            held.append(s)
        return [s.getsockname()[1] for s in held]
    finally:
        for s in held:
            s.close()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (see free_ports)."""
    return free_ports(1)[0]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True)
class StackConfig:
    """What the processes of one stack are started with. A setting left None is the service's own default.

    The defaults make a small float32 stack on the CPU, for tests; `specserve up` sets
    every field from its flags.
    """

    model: Path
    dtype: str = "float32"
    quantization: str = "none"  # the target workers' --quantization (modeling/kernels/blocks.py)
    draft_quantization: str = "none"  # a draft model's (--draft model:PATH)
    device: str = "cpu"  # cpu, or cuda: target worker i on cuda:i, the draft service on cuda:0
    num_workers: int = 1
    kv_cache_memory_gib: float | None = 0.5  # each target worker's KV cache; None: the worker's default share
    draft_num_seqs: int = 64  # sequences the draft service drafts for at once
    max_model_len: int = MAX_MODEL_LEN
    max_num_batched_tokens: int = 256
    num_threads_per_worker: int | None = None  # threads of each target worker; None: its default (its cores)
    draft: DraftSpec | None = None  # the draft service's proposer; None: no draft service
    head_draft_tokens: int | None = None  # the draft service's --head-draft-tokens
    token_trees: bool = True  # phrases: the draft service proposes token trees, not chains
    suffix_cache_tokens: int | None = None  # the draft service's --suffix-cache-tokens
    suffix_scope: str | None = None  # the draft service's --suffix-scope
    max_num_seqs: int | None = None  # the scheduler's and the workers' --max-num-seqs
    prefix_cache: bool = True  # False: the scheduler's --no-prefix-cache
    prefix_cache_scope: str | None = None  # the gateway's --prefix-cache-scope
    api_key_file: Path | None = None  # the gateway's --api-key-file (SPECSERVE_API_KEY reaches it in the environment)
    reasoning_parser: str | None = None  # the gateway's --reasoning-parser
    tool_call_parser: str | None = None  # the gateway's --tool-call-parser
    chat_template: Path | None = None  # the gateway's --chat-template
    # The gateway's --tls-certfile, --tls-keyfile, --tls-ca-certfile: both public ports on TLS (gateway/tls.py).
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = None
    tls_ca_certfile: Path | None = None
    allowed_origins: str | None = None  # the gateway's --allowed-origins (comma-separated)
    num_speculative_tokens: int | None = None  # the scheduler's k; also the draft service's --max-draft-tokens
    spec_disable_batch_threshold: int | None = None
    spec_draft_token_budget: int | None = None
    speculation_policy: str | None = None  # the scheduler's --speculation-policy (None: its default, goodput)
    scheduling_policy: str | None = None  # the scheduler's --scheduling-policy (None: its default, fcfs)
    require_batch_invariance: bool = False  # the workers' --require-batch-invariance
    cuda_graphs: str = "auto"  # the workers' --cuda-graphs
    gateway_shutdown_grace_s: float | None = None
    host: str = "127.0.0.1"  # where the gateway listens
    grpc_port: int | None = None  # None: a free port, picked with the stack's addresses
    http_port: int | None = None  # None: a free port, picked with the stack's addresses
    log_json: bool = False
    keys: Path | None = None  # the CurveZMQ key folder every process is given (LocalStack makes one when None)
    insecure_loopback: bool = False  # no keys: every process runs --insecure-loopback
    scheduler_args: tuple[str, ...] = ()  # more flags for a service, as they are (tests)
    worker_args: tuple[str, ...] = ()
    draft_args: tuple[str, ...] = ()

    def worker_device(self, index: int | str) -> str:
        """Target worker i on cuda:i; a worker a test names (worker-faulty) shares cuda:0."""
        if self.device != "cuda":
            return self.device
        return f"cuda:{index}" if isinstance(index, int) else "cuda:0"


@dataclass(frozen=True)
class StackAddresses:
    """Where a stack's processes listen and connect; the scheduler's two sockets are on free local ports."""

    host: str  # the gateway's gRPC and HTTP servers
    grpc_port: int
    http_port: int
    gateway_address: str  # the scheduler's socket for gateways
    worker_address: str  # the scheduler's socket for target workers and the draft service

    @classmethod
    def pick(cls, config: StackConfig) -> StackAddresses:
        given = [port for port in (config.grpc_port, config.http_port) if port]
        grpc_port, http_port, gateway_port, worker_port = free_ports(4, taken=given)
        return cls(
            host=config.host,
            grpc_port=config.grpc_port or grpc_port,
            http_port=config.http_port or http_port,
            gateway_address=f"tcp://127.0.0.1:{gateway_port}",
            worker_address=f"tcp://127.0.0.1:{worker_port}",
        )


# ---------------------------------------------------------------- command lines


def service_specs(config: StackConfig, addresses: StackAddresses) -> list[ServiceSpec]:
    """Every process of the stack, in start order: the scheduler, the target workers, the draft service, the gateway."""
    specs = [scheduler_spec(config, addresses)]
    specs += [worker_spec(config, addresses, i) for i in range(config.num_workers)]
    if config.draft is not None:
        specs.append(draft_spec(config, addresses, config.draft))
    specs.append(gateway_spec(config, addresses))
    return specs


def scheduler_spec(config: StackConfig, addresses: StackAddresses) -> ServiceSpec:
    return ServiceSpec(
        "scheduler",
        _python(
            "scheduler",
            settings.argv(
                "scheduler",
                {
                    "gateway_address": addresses.gateway_address,
                    "worker_address": addresses.worker_address,
                    "model_name": config.model.name,
                    "max_model_len": config.max_model_len,
                    "max_num_batched_tokens": config.max_num_batched_tokens,
                    "max_num_seqs": config.max_num_seqs,
                    "num_speculative_tokens": config.num_speculative_tokens,
                    "spec_disable_batch_threshold": config.spec_disable_batch_threshold,
                    "spec_draft_token_budget": config.spec_draft_token_budget,
                    "speculation_policy": config.speculation_policy,
                    "scheduling_policy": config.scheduling_policy,
                    "prefix_cache": None if config.prefix_cache else False,
                },
            )
            + list(config.scheduler_args),
            config,
        ),
        stop_order=3,
    )


def worker_spec(
    config: StackConfig, addresses: StackAddresses, index: int | str, extra_args: tuple[str, ...] = ()
) -> ServiceSpec:
    """Target worker `index`, whose id is worker-INDEX (a test may name one, e.g. worker-faulty); past the restart
    limit it stays down and the other workers serve."""
    name = f"worker-{index}"
    return ServiceSpec(
        name,
        _python(
            "gpu_worker",
            settings.argv(
                "worker",
                {
                    "worker_id": name,
                    "model": config.model,
                    "scheduler_address": addresses.worker_address,
                    "device": config.worker_device(index),
                    "dtype": config.dtype,
                    "max_model_len": config.max_model_len,
                    "max_num_batched_tokens": config.max_num_batched_tokens,
                    "kv_cache_memory": config.kv_cache_memory_gib,
                    "max_num_seqs": config.max_num_seqs,
                    "quantization": config.quantization,
                    "num_threads": config.num_threads_per_worker,
                    "require_batch_invariance": config.require_batch_invariance,
                    "cuda_graphs": config.cuda_graphs,
                },
            )
            + [*config.worker_args, *extra_args],
            config,
        ),
        stop_order=1,
        essential=False,
    )


def draft_spec(config: StackConfig, addresses: StackAddresses, draft: DraftSpec) -> ServiceSpec:
    """The draft service proposing with `draft`; past the restart limit the others go on without it."""
    k = config.num_speculative_tokens
    return ServiceSpec(
        "draft",
        _python(
            "draft_service",
            settings.argv(
                "draft",
                {
                    "worker_id": DRAFT_ID,
                    "proposer": draft,
                    "target_model": config.model if draft.needs_target_model else None,
                    "head_draft_tokens": config.head_draft_tokens,
                    "quantization": config.draft_quantization,
                    "max_draft_tokens": None if k is None else max(k, 1),
                    "token_trees": None if config.token_trees else False,
                    "suffix_cache_tokens": config.suffix_cache_tokens,
                    "suffix_scope": config.suffix_scope,
                    "scheduler_address": addresses.worker_address,
                    "device": config.worker_device(0),
                    "dtype": config.dtype,
                    "max_model_len": config.max_model_len,
                    "num_seqs": config.draft_num_seqs,
                    "num_targets": config.num_workers if config.num_workers > 1 else None,
                    # One thread on a CPU (the draft service's default): the cores are the target workers'.
                    "num_threads": None if config.device == "cpu" else 0,
                },
            )
            + list(config.draft_args),
            config,
        ),
        stop_order=1,
        essential=False,
    )


def gateway_spec(config: StackConfig, addresses: StackAddresses) -> ServiceSpec:
    return ServiceSpec(
        "gateway",
        _python(
            "gateway",
            settings.argv(
                "gateway",
                {
                    "model": config.model,
                    "scheduler_address": addresses.gateway_address,
                    "host": addresses.host,
                    "port": addresses.grpc_port,
                    "http_port": addresses.http_port,
                    "shutdown_grace_s": config.gateway_shutdown_grace_s,
                    "prefix_cache_scope": config.prefix_cache_scope,
                    "api_key_file": config.api_key_file,
                    "reasoning_parser": config.reasoning_parser,
                    "tool_call_parser": config.tool_call_parser,
                    "chat_template": config.chat_template,
                    "tls_certfile": config.tls_certfile,
                    "tls_keyfile": config.tls_keyfile,
                    "tls_ca_certfile": config.tls_ca_certfile,
                    "allowed_origins": None if config.allowed_origins is None else [config.allowed_origins],
                },
            ),
            config,
        ),
        stop_order=0,
    )


def _python(module: str, module_argv: list[str], config: StackConfig) -> list[str]:
    return [
        sys.executable,
        "-m",
        module,
        *module_argv,
        *transport_args(config),
        *(["--log-json"] if config.log_json else []),
    ]


def transport_args(config: StackConfig) -> list[str]:
    if config.insecure_loopback:
        return ["--insecure-loopback"]
    if config.keys is None:
        raise ValueError("a stack needs a key folder (StackConfig.keys), or insecure_loopback")
    return ["--keys", str(config.keys)]


def with_keys(config: StackConfig, folder: Path) -> StackConfig:
    """`config` with its key folder: as given, or made in `folder` (unless it runs without keys)."""
    if config.insecure_loopback or config.keys is not None:
        return config
    make_keys(folder)
    return replace(config, keys=folder)
