"""The gateway's link to the scheduler: one DEALER socket,
replies demultiplexed to per-request streams and info queries.

Each request's own side (its states, reading, aborting, resuming) is `gateway.request_stream.RequestStream`.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from typing import assert_never

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from common.logs import get_logger
from common.protocol_errors import ProtocolErrors
from common.transport import HANDSHAKE_EVENTS, Transport
from gateway.errors import InvalidArgument, SchedulerUnavailable
from gateway.request_stream import RequestMessage, RequestStream
from proto import frames, messages


class SchedulerClient:
    """Talks to the scheduler's ROUTER; `connect()`, then run `run()` as a task for as long as the link is used.

    Every received frame is decoded once: TokenDelta / RequestError go to the queue of
    their request (dropped, and counted, when the request is unknown), InfoReply to the
    query waiting for its query_id. A malformed frame is counted, logged (the first of its kind) and dropped.
    """

    def __init__(
        self,
        address: str,
        gateway_id: str,
        *,
        reply_timeout_s: float,
        restart_window_s: float = 60.0,
        transport: Transport = Transport(None),
    ) -> None:
        self.address = address
        self.gateway_id = gateway_id
        self.transport = transport
        self.handshake_problem: str | None = None  # why the scheduler refused the last handshake, until one succeeds
        self.reply_timeout_s = reply_timeout_s  # how long an info query waits; see --scheduler-timeout-s
        self.restart_window_s = restart_window_s  # how long a request in flight waits for it to come back
        self.protocol_errors = ProtocolErrors("gateway.scheduler")  # malformed frames: counted, first of a kind logged
        self._log = get_logger(component="scheduler_client")
        self.num_dropped_messages = 0
        self._codec_out: messages.Codec[messages.GatewayToScheduler] = messages.Codec(messages.GatewayToScheduler)
        self._codec_in: messages.Codec[messages.SchedulerToGateway] = messages.Codec(messages.SchedulerToGateway)
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._streams: dict[str, RequestStream] = {}  # by the id the scheduler knows them by
        # The ids the scheduler knows requests by are this gateway's own, never a client's: a random prefix of this
        # process, then a count. A client's request_id (SGLang's rid) is only what its own replies carry, so no two
        # clients' requests can meet in the scheduler, whatever ids they choose.
        self._incarnation = uuid.uuid4().hex[:16]  # this process's, in its hello and heartbeats
        self._scheduler_ids = (f"{self._incarnation}-{n}" for n in itertools.count(1))
        self._queries: dict[int, asyncio.Future[messages.InfoReply]] = {}
        self._query_ids = itertools.count(1)
        self._last_heard_at = -float("inf")  # time.monotonic() of the last frame received
        self._max_model_len: int | None = None  # the scheduler's, as its last InfoReply said
        self._connected = (
            asyncio.Event()
        )  # set while the connection is up and its handshake done, per the socket monitor

    # ------------------------------------------------------------------ lifecycle

    async def connect(self) -> None:
        """Create the socket and queue the GatewayHello; the connection itself is made in the background."""
        if self._socket is not None:
            raise RuntimeError("SchedulerClient.connect called twice")
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTING_ID, self.gateway_id.encode())
        # A larger frame drops the connection at its header: all a server without the scheduler's key can make this
        # gateway hold (proto/frames.py; the scheduler keeps to it).
        self._socket.setsockopt(zmq.MAXMSGSIZE, frames.scheduler_to_gateway())
        self.transport.join(self._socket, "gateway")
        # Monitor before connecting, so the first handshake is seen and counted too.
        self._monitor = self._socket.get_monitor_socket(HANDSHAKE_EVENTS)
        self._socket.connect(self.address)
        await self._send_hello()

    async def run(self) -> None:
        """Receive until cancelled; also re-sends the hello whenever the connection is made again, and says a
        heartbeat every GATEWAY_HEARTBEAT_INTERVAL_S."""
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(self._receive_loop(), name="scheduler_client.receive")
            tasks.create_task(self._monitor_loop(), name="scheduler_client.monitor")
            tasks.create_task(self._heartbeat_loop(), name="scheduler_client.heartbeat")

    def close(self) -> None:
        for future in self._queries.values():
            future.cancel()
        if self._context is not None:
            self._context.destroy(linger=0)
        self._context = self._socket = self._monitor = None

    # ------------------------------------------------------------------ public API

    def open_request(self, request_id: str) -> RequestStream:
        """Register a request's stream under an id of the gateway's own; use the result as `async with`.

        `request_id` is the client's (or one made for it): replies and log lines carry it; several requests may
        share it."""
        stream = RequestStream(self, request_id, self.new_scheduler_id())
        self._streams[stream.scheduler_id] = stream
        return stream

    def new_scheduler_id(self) -> str:
        return next(self._scheduler_ids)

    def close_request(self, stream: RequestStream) -> None:
        """Forget a request; its later messages are dropped."""
        self._streams.pop(stream.scheduler_id, None)

    async def send(self, message: messages.GatewayToScheduler) -> None:
        """Queue one message; raises SchedulerUnavailable if the socket stays full for reply_timeout_s, and
        InvalidArgument for a request larger than the scheduler's socket takes (`_check_size`)."""
        frame = self._codec_out.encode(message)
        await self._check_size(frame)
        try:
            async with asyncio.timeout(self.reply_timeout_s):
                await self._require_socket().send(frame)
        except TimeoutError as error:
            raise SchedulerUnavailable(self._silence_message()) from error

    async def _check_size(self, frame: bytes) -> None:
        """Raises InvalidArgument for a frame over the scheduler's bound (proto/frames.py): the scheduler would drop
        this gateway's connection at its header. Only a prompt longer than the context makes one, which the scheduler
        would refuse anyway."""
        if len(frame) <= frames.gateway_to_scheduler(1):  # what a scheduler of any context takes
            return
        max_model_len = await self.max_model_len()
        if len(frame) > (limit := frames.gateway_to_scheduler(max_model_len)):
            raise InvalidArgument(
                "prompt",
                f"the request is {len(frame)} bytes as the scheduler reads it, more than "
                f"the {limit} it takes: the prompt is longer than the context of "
                f"{max_model_len} tokens",
            )

    async def query_info(self, *, flush_prefix_cache: bool = False) -> messages.InfoReply:
        """The scheduler's InfoReply (after it forgot the prefix cache's unheld pages, with `flush_prefix_cache`);
        raises SchedulerUnavailable when none comes within reply_timeout_s.

        Nothing is sent while disconnected, so queries do not pile up for a scheduler that is down.
        """
        query_id = next(self._query_ids)
        future: asyncio.Future[messages.InfoReply] = asyncio.get_running_loop().create_future()
        self._queries[query_id] = future
        try:
            async with asyncio.timeout(self.reply_timeout_s):
                await self._connected.wait()
                query = messages.InfoQuery(query_id=query_id, flush_prefix_cache=flush_prefix_cache)
                await self._require_socket().send(self._codec_out.encode(query))
                return await future
        except TimeoutError as error:
            raise SchedulerUnavailable(self._silence_message()) from error
        finally:
            self._queries.pop(query_id, None)

    async def max_model_len(self) -> int:
        """The most tokens a request may hold (prompt and completion), as the scheduler last said; asks it when it has
        not said yet (raises SchedulerUnavailable when it does not answer)."""
        if self._max_model_len is None:
            return (await self.query_info()).max_model_len
        return self._max_model_len

    async def ensure_reachable(self) -> None:
        """Return at once if the scheduler spoke lately, else ask it; raises SchedulerUnavailable."""
        if time.monotonic() - self._last_heard_at > self.reply_timeout_s:
            await self.query_info()

    async def wait_reachable(self) -> None:
        """Like ensure_reachable, but a scheduler that does not answer is asked again, with growing pauses, for up to
        restart_window_s: a supervisor restarting it takes seconds, and the requests in flight resume on the new one
        (`_resume_streams`). Raises SchedulerUnavailable once the window has passed."""
        deadline = time.monotonic() + self.restart_window_s
        pause_s = 0.25
        while True:
            try:
                await self.ensure_reachable()
                return
            except SchedulerUnavailable as error:
                if time.monotonic() >= deadline:
                    raise SchedulerUnavailable(
                        f"{error.message}; it did not come back within {self.restart_window_s:g} s "
                        "(--scheduler-restart-window-s)"
                    ) from error
            await asyncio.sleep(min(pause_s, max(0.0, deadline - time.monotonic())))
            pause_s = min(2 * pause_s, 2.0)

    # ------------------------------------------------------------------ receiving

    async def _receive_loop(self) -> None:
        socket = self._require_socket()
        while True:
            frames = await socket.recv_multipart()
            self._last_heard_at = time.monotonic()
            self._dispatch(frames)

    def _dispatch(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            self.protocol_errors.record("frames", num_frames=len(frames))
            return
        try:
            message = self._codec_in.decode(frames[0])
        except msgspec.DecodeError as error:  # ValidationError is a DecodeError too
            self.protocol_errors.record("decode", error=str(error), num_bytes=len(frames[0]), head=frames[0][:32].hex())
            return
        match message:
            case messages.TokenDelta() | messages.RequestError():
                self._route_to_request(message)
            case messages.TokenDeltas(deltas=deltas):
                for delta in deltas:
                    self._route_to_request(delta)
            case messages.InfoReply():
                self._resolve_query(message)
            case messages.Probe():  # the scheduler checking that this connection is up: nothing to do
                pass
            case _:
                assert_never(message)

    def _route_to_request(self, message: RequestMessage) -> None:
        stream = self._streams.get(message.request_id)
        if stream is None:  # normal after an abort or a client that went away
            self.num_dropped_messages += 1
            self._log.debug("scheduler.message_dropped", request_id=message.request_id, type=type(message).__name__)
            return
        stream.deliver(message)

    def _resolve_query(self, reply: messages.InfoReply) -> None:
        self._max_model_len = reply.max_model_len
        future = self._queries.get(reply.query_id)
        if future is not None and not future.done():
            future.set_result(reply)

    # ------------------------------------------------------------------ connection events

    async def _monitor_loop(self) -> None:
        if self._monitor is None:
            raise RuntimeError("SchedulerClient is not connected: call connect() first")
        num_connects = 0
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                num_connects += 1
                self.handshake_problem = None
                self._connected.set()
                self._log.info("scheduler.connected", address=self.address, num_connects=num_connects)
                if num_connects > 1:  # the first hello went out with connect()
                    try:
                        await self._send_hello()
                        await self._resume_streams()
                    except SchedulerUnavailable as error:  # the streams left find out through their liveness checks
                        self._log.error("scheduler.reconnect_incomplete", error=error.message)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                if self._connected.is_set():
                    self._log.warning("scheduler.disconnected", address=self.address)
                self._connected.clear()
            elif (refused := self.transport.handshake_failure(event["event"], "gateway")) is not None:
                if refused != self.handshake_problem:  # ZeroMQ retries every few seconds: logged once per cause
                    self._log.error(
                        "scheduler.refused_handshake",
                        address=self.address,
                        transport=self.transport.describe(),
                        reason=refused,
                    )
                self.handshake_problem = refused

    async def _resume_streams(self) -> None:
        """The connection came back: the scheduler at the other end may be a restarted one that knows none of the
        requests in flight. Each goes on there from the tokens already received (`RequestStream.resumption`); the
        one the old scheduler knew is aborted, in case it is still the same scheduler and still runs it."""
        resumed = 0
        for stream in list(self._streams.values()):
            old_id = stream.scheduler_id
            resumption = stream.resumption()
            if resumption is None:
                continue
            abort, submit = resumption
            del self._streams[old_id]
            self._streams[stream.scheduler_id] = stream
            try:
                await self.send(abort)
                await self.send(submit)
            except SchedulerUnavailable as error:  # it cannot go on: its client is told, never left waiting
                stream.deliver(messages.RequestError(stream.scheduler_id, "UNAVAILABLE", error.message))
                continue
            except InvalidArgument as error:  # too long for a scheduler with a shorter context than the last one
                stream.deliver(messages.RequestError(stream.scheduler_id, "INVALID_ARGUMENT", error.message))
                continue
            resumed += 1
        if resumed:
            self._log.warning(
                "scheduler.requests_resumed",
                num_requests=resumed,
                note="the scheduler connection came back; requests in flight go on from their tokens",
            )

    async def _send_hello(self) -> None:
        hello = messages.GatewayHello(
            gateway_id=self.gateway_id, protocol_version=messages.PROTOCOL_VERSION, incarnation=self._incarnation
        )
        await self.send(hello)

    async def _heartbeat_loop(self) -> None:
        """While connected: a scheduler that hears nothing from this gateway for its --heartbeat-timeout-s counts it
        missing, and after its --gateway-gone-grace-s aborts its requests. None is queued while disconnected: the
        hello says it all on reconnecting."""
        heartbeat = messages.GatewayHeartbeat(
            gateway_id=self.gateway_id, protocol_version=messages.PROTOCOL_VERSION, incarnation=self._incarnation
        )
        while True:
            await asyncio.sleep(messages.GATEWAY_HEARTBEAT_INTERVAL_S)
            if not self._connected.is_set():
                continue
            try:
                await self.send(heartbeat)
            except SchedulerUnavailable as error:  # its queue stayed full: the streams' liveness checks deal with it
                self._log.warning("scheduler.heartbeat_not_sent", error=error.message)

    def _require_socket(self) -> zmq.asyncio.Socket:
        if self._socket is None:
            raise RuntimeError("SchedulerClient is not connected: call connect() first")
        return self._socket

    def _silence_message(self) -> str:
        if self.handshake_problem is not None:
            return f"the scheduler at {self.address} refused this gateway's connection: {self.handshake_problem}"
        return (
            f"the scheduler at {self.address} did not answer within {self.reply_timeout_s:g} s "
            "(is it running? the wait is set by --scheduler-timeout-s)"
        )
