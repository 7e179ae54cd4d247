"""The gateway process as a whole: start in named phases, serve until a signal, drain, stop."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from aiohttp import web
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.logs import get_logger
from gateway.config import GatewayConfig
from gateway.errors import StartupError
from gateway.generation import Generation
from gateway.health import HealthReporter
from gateway.http_api import HttpApi
from gateway.http_body import BodyLimits
from gateway.metrics import GatewayMetrics
from gateway.scheduler_client import SchedulerClient
from gateway.server import SpecServeServicer, add_servicer
from gateway.structured_request import GrammarCompiler
from common.text.tokenizer import Tokenizer, TokenizerLoadError
from proto import specserve_pb2 as pb

SPECSERVE_SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["SpecServe"].full_name


class ShutdownSignals:
    """SIGTERM / SIGINT: the first asks for a drain, the second for an immediate stop."""

    def __init__(self) -> None:
        self.drain_requested = asyncio.Event()
        self.stop_now_requested = asyncio.Event()
        self._num_signals = 0
        self._log = get_logger(component="signals")

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)

    def uninstall(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)

    def _on_signal(self, signum: signal.Signals) -> None:
        self._num_signals += 1
        self._log.info("gateway.signal", signal=signum.name, num_signals=self._num_signals)
        event = self.drain_requested if self._num_signals == 1 else self.stop_now_requested
        event.set()


class Gateway:
    """Owns the gRPC server, the scheduler link and the health reporter; `run()` is the whole process life."""

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._signals = ShutdownSignals()
        self._log = get_logger(component="gateway")

    async def run(self) -> None:
        """Start (raises StartupError, undoing what was started), serve until a signal, drain."""
        self._signals.install()
        async with contextlib.AsyncExitStack() as resources:
            resources.callback(self._signals.uninstall)
            with self._phase("load_tokenizer"):
                tokenizer = load_tokenizer(self._config.model_dir, self._config.chat_template)
            with self._phase("connect_scheduler"):
                scheduler = SchedulerClient(
                    self._config.scheduler_address,
                    self._config.gateway_id,
                    reply_timeout_s=self._config.scheduler_timeout_s,
                    restart_window_s=self._config.scheduler_restart_window_s,
                    transport=self._config.transport,
                )
                resources.callback(scheduler.close)
                await scheduler.connect()
            with self._phase("start_server"):
                # No SO_REUSEPORT: a second gateway on a taken port must fail, not share it.
                server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
                reporter = HealthReporter(
                    health.aio.HealthServicer(), scheduler, poll_interval_s=self._config.health_poll_interval_s
                )
                generation = Generation(
                    tokenizer,
                    scheduler,
                    GatewayMetrics(),
                    GrammarCompiler(tokenizer),
                    cache_scope=self._config.prefix_cache_scope,
                )
                add_services(server, SpecServeServicer(generation, self._config.api_keys), reporter.servicer)
                port = self._bind(server)
                await reporter.start()
                await server.start()
                resources.push_async_callback(server.stop, None)
            with self._phase("start_http"):
                limits = BodyLimits(self._config.http_max_body_bytes, self._config.http_read_timeout_s)
                http = HttpApi(
                    generation,
                    reporter,
                    self._config.model_dir.name,
                    limits,
                    self._config.api_keys,
                    self._config.cors,
                    self._config.reasoning_parser,
                    self._config.tool_call_parser,
                    client_certificates=self._config.tls is not None and self._config.tls.mutual,
                )
                runner = http.runner()
                await runner.setup()
                resources.push_async_callback(runner.cleanup)
                http_port = await self._bind_http(runner)
            self._log.info(
                "gateway.listening",
                host=self._config.host,
                port=port,
                http_port=http_port,
                model=str(self._config.model_dir),
                api_keys=len(self._config.api_keys.digests),
                tls="off" if self._config.tls is None else "mutual" if self._config.tls.mutual else "on",
                prefix_cache_scope=self._config.prefix_cache_scope,
            )
            await self._serve(server, scheduler, reporter, http)
        self._log.info("gateway.stopped")

    async def _bind_http(self, runner: web.AppRunner) -> int:
        tls = self._config.tls
        site = web.TCPSite(
            runner,
            self._config.host,
            self._config.http_port,
            reuse_port=False,
            ssl_context=None if tls is None else tls.ssl_context(),
        )
        try:
            await site.start()
        except OSError as error:
            raise StartupError(
                f"cannot listen on {self._config.host}:{self._config.http_port}: {error} "
                "(is the port in use? see --http-port)"
            ) from error
        server = site._server  # the bound socket tells the port that 0 picked
        sockets = getattr(server, "sockets", None) or []
        return int(sockets[0].getsockname()[1]) if sockets else self._config.http_port

    async def _serve(
        self, server: grpc.aio.Server, scheduler: SchedulerClient, reporter: HealthReporter, http: HttpApi
    ) -> None:
        async with asyncio.TaskGroup() as tasks:
            background = [
                tasks.create_task(scheduler.run(), name="scheduler_client"),
                tasks.create_task(reporter.run(), name="health_reporter"),
            ]
            await self._signals.drain_requested.wait()
            http.draining = True
            await self._drain(server, reporter, http)
            for task in background:
                task.cancel()

    async def _drain(self, server: grpc.aio.Server, reporter: HealthReporter, http: HttpApi) -> None:
        """Refuse new RPCs and HTTP requests, let those in flight (gRPC streams and HTTP requests alike) finish
        within the grace period; a second signal cuts it short."""
        grace_s = self._config.shutdown_grace_s
        self._log.info("gateway.draining", grace_s=grace_s)
        await reporter.enter_shutdown()
        graceful = asyncio.create_task(server.stop(grace_s), name="server_stop")
        http_done = asyncio.create_task(asyncio.wait_for(http.wait_idle(), grace_s), name="http_drain")
        stop_now = asyncio.create_task(self._signals.stop_now_requested.wait(), name="stop_now")
        drained = asyncio.create_task(asyncio.wait({graceful, http_done}), name="drained")
        done, _ = await asyncio.wait({drained, stop_now}, return_when=asyncio.FIRST_COMPLETED)
        if stop_now in done:
            self._log.info("gateway.stopping_now")
            await server.stop(None)
        for task in (stop_now, http_done, drained):
            task.cancel()
        await graceful
        await asyncio.gather(http_done, drained, return_exceptions=True)  # a timeout or a cancel: the grace is over

    def _bind(self, server: grpc.aio.Server) -> int:
        address = f"{self._config.host}:{self._config.port}"
        try:
            tls = self._config.tls
            port: int = (
                server.add_insecure_port(address)
                if tls is None
                else server.add_secure_port(address, tls.grpc_credentials())
            )
        except RuntimeError as error:
            raise StartupError(f"cannot listen on {address}: {error} (is the port in use? see --port)") from error
        if port == 0:
            raise StartupError(f"cannot listen on {address} (is the port in use? see --port)")
        return port

    @contextlib.contextmanager
    def _phase(self, name: str) -> Iterator[None]:
        started_at = time.monotonic()
        self._log.info("gateway.phase_started", phase=name)
        try:
            yield
        except Exception as error:
            duration_s = round(time.monotonic() - started_at, 3)
            self._log.error("gateway.phase_failed", phase=name, duration_s=duration_s, error_type=type(error).__name__)
            raise
        self._log.info("gateway.phase_done", phase=name, duration_s=round(time.monotonic() - started_at, 3))


def add_services(
    server: grpc.aio.Server, servicer: SpecServeServicer, health_servicer: health.aio.HealthServicer
) -> None:
    """SpecServe, grpc.health.v1.Health and server reflection (so `grpcurl list` works)."""
    add_servicer(server, servicer)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SPECSERVE_SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)


def load_tokenizer(model_dir: Path, chat_template: Path | None = None) -> Tokenizer:
    """The model's tokenizer (with `chat_template` in place of its own, when given); a folder it cannot be read from
    is a StartupError, with the tokenizer's message."""
    try:
        tokenizer = Tokenizer.load(model_dir, chat_template)
    except TokenizerLoadError as error:
        raise StartupError(str(error)) from error
    tokenizer.longest_token_bytes  # measured once here (a pass over the vocabulary), not in the first request's turn
    return tokenizer
