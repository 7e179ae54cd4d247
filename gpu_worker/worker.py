"""The worker process: phased start-up under the lifecycle, then a synchronous step loop."""

from __future__ import annotations

import os
import signal
import threading
import time
import types

import msgspec
import torch
import zmq

from common.logs import get_logger
from common.status_file import write_status_file
from common.protocol_errors import ProtocolErrors
from gpu_worker.config import WorkerConfig
from gpu_worker.runner import ModelRunner
from modeling.config import ModelConfig, model_fingerprint
from modeling.kv_cache import SlotError
from proto import messages as m
from proto.lifecycle import Lifecycle, State

log = get_logger()

_POLL_MS = 100


class Worker:
    """One target model replica. `run()` returns the process exit code."""

    def __init__(self, config: WorkerConfig) -> None:
        self._config = config
        self._incarnation = time.time_ns()
        self._lifecycle = Lifecycle(self._on_transition)
        self._codec: m.Codec[m.SchedulerToWorker] = m.Codec(m.SchedulerToWorker)
        self._errors = ProtocolErrors("worker")
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._send_lock = threading.Lock()
        self._runner: ModelRunner | None = None
        self._num_steps = 0
        self._stop_requested = threading.Event()
        self._log = log.bind(worker_id=config.worker_id, incarnation=self._incarnation)

    # ------------------------------------------------------------------ start-up

    def run(self) -> int:
        self._install_signal_handlers()
        try:
            if not self._start():
                self._close()
                return 0
        except Exception as exc:  # noqa: BLE001 - any init failure ends in FAILED, reported with its cause
            return self._fail(exc)
        try:
            self._serve()
        except Exception as exc:  # noqa: BLE001 - a crash in a step is fatal for this process
            return self._fail(exc)
        finally:
            self._close()
        return 0

    def _start(self) -> bool:
        """The start-up phases; True once READY, False when told to stop on the way."""
        cfg = self._config
        self._socket.setsockopt(zmq.IDENTITY, cfg.worker_id.encode())
        self._socket.setsockopt(zmq.LINGER, 2000)
        self._socket.connect(cfg.scheduler_address)
        model_config = ModelConfig.from_folder(cfg.model)
        if cfg.max_model_len > model_config.max_position_embeddings:
            raise ValueError(f"--max-model-len {cfg.max_model_len} exceeds the model's {model_config.max_position_embeddings} positions")
        self._send(m.WorkerHello(
            worker_id=cfg.worker_id, role="target", incarnation=self._incarnation, protocol_version=m.PROTOCOL_VERSION,
            pid=os.getpid(), model_name=cfg.model.name, model_fingerprint=model_fingerprint(cfg.model),
            vocab_size=model_config.vocab_size, max_model_len=cfg.max_model_len, num_kv_slots=cfg.num_kv_slots,
            dtype=cfg.dtype, device=cfg.device,
        ))
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()
        if cfg.num_threads > 0:
            torch.set_num_threads(cfg.num_threads)
        runner = ModelRunner(cfg, model_config)
        for state, phase in ((State.LOADING, runner.load), (State.ALLOCATING, runner.allocate), (State.WARMING, runner.warm_up)):
            self._lifecycle.move_to(state)
            phase()
            self._handle_queued_messages()  # a step sent before READY is refused, never run later
            if self._stop_requested.is_set():
                self._lifecycle.move_to(State.STOPPED)
                return False
        self._runner = runner
        self._lifecycle.move_to(State.READY)
        return True

    def _fail(self, exc: BaseException) -> int:
        phase = self._lifecycle.state
        self._log.error("worker.failed", phase=phase, error_type=type(exc).__name__, error=str(exc), exc_info=exc)
        self._send(m.WorkerFailed(
            worker_id=self._config.worker_id, incarnation=self._incarnation, phase=phase,
            error_type=type(exc).__name__, message=str(exc),
        ))
        if self._lifecycle.state not in (State.FAILED, State.STOPPED):
            self._lifecycle.move_to(State.FAILED)
        self._close()
        return 1

    # ------------------------------------------------------------------ serving

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop_requested.is_set():
            if poller.poll(_POLL_MS):
                self._handle_frame(self._socket.recv())
        self._lifecycle.move_to(State.DRAINING)
        self._lifecycle.move_to(State.STOPPED)

    def _handle_queued_messages(self) -> None:
        while self._socket.poll(0):
            self._handle_frame(self._socket.recv())

    def _handle_frame(self, frame: bytes) -> None:
        try:
            message = self._codec.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._errors.record("decode", error=str(exc), num_bytes=len(frame))
            return
        match message:
            case m.StepRequest():
                self._handle_step(message)
            case m.ReleaseSlots():
                self._handle_release(message)
            case m.Drain():
                if message.incarnation == self._incarnation:
                    self._stop_requested.set()
                else:
                    self._errors.record("stale_incarnation", message="drain", incarnation=message.incarnation)

    def _handle_step(self, step: m.StepRequest) -> None:
        state = self._lifecycle.state
        if state is not State.READY or self._runner is None:
            self._refuse(step, f"not READY (state {state})")
            return
        if step.incarnation != self._incarnation:
            self._refuse(step, f"step for incarnation {step.incarnation}, this is {self._incarnation}")
            return
        started = time.perf_counter()
        try:
            outputs = self._runner.execute(step.seqs)
        except SlotError as exc:
            self._refuse(step, str(exc))
            return
        self._num_steps += 1
        duration_ms = (time.perf_counter() - started) * 1000
        for work in step.seqs:
            if work.start_position == 0:  # one line per request on this worker, so a grep finds it here too
                self._log.info("seq.started", request_id=work.request_id, slot=work.slot, step_id=step.step_id)
        self._send(m.StepResult(
            worker_id=self._config.worker_id, incarnation=self._incarnation, step_id=step.step_id,
            outputs=outputs, duration_ms=duration_ms,
        ))
        self._log.debug("step.done", step_id=step.step_id, num_seqs=len(step.seqs), duration_ms=round(duration_ms, 2),
                        request_ids=[w.request_id for w in step.seqs])

    def _handle_release(self, release: m.ReleaseSlots) -> None:
        if release.incarnation != self._incarnation or self._runner is None:
            self._errors.record("stale_incarnation", message="release", incarnation=release.incarnation)
            return
        try:
            self._runner.release(release.slots)
        except SlotError as exc:
            self._errors.record("bad_release", error=str(exc))

    def _refuse(self, step: m.StepRequest, reason: str) -> None:
        self._log.warning("step.refused", step_id=step.step_id, reason=reason)
        self._send(m.StepRefused(
            worker_id=self._config.worker_id, incarnation=self._incarnation, step_id=step.step_id,
            state=self._lifecycle.state, reason=reason,
        ))

    # ------------------------------------------------------------------ plumbing

    def _on_transition(self, old: State, new: State, duration_s: float) -> None:
        self._log.info("lifecycle.transition", previous=old, state=new, previous_duration_s=round(duration_s, 3))
        if self._config.status_file is not None:
            write_status_file(self._config.status_file, new)
        self._send(m.LifecycleReport(
            worker_id=self._config.worker_id, incarnation=self._incarnation, state=new,
            previous_state=old, previous_duration_s=duration_s,
        ))

    def _heartbeat_loop(self) -> None:
        """Runs on its own thread and socket, so heartbeats go on during long phases."""
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, f"{self._config.worker_id}/heartbeat".encode())
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(self._config.scheduler_address)
        while self._lifecycle.state not in (State.STOPPED, State.FAILED):
            runner = self._runner
            socket.send(self._codec.encode(m.Heartbeat(
                worker_id=self._config.worker_id, incarnation=self._incarnation, state=self._lifecycle.state,
                num_used_kv_slots=runner.num_used_slots if runner else 0, num_steps=self._num_steps,
            )))
            time.sleep(self._config.heartbeat_interval_s)
        socket.close()

    def _send(self, message: msgspec.Struct) -> None:
        with self._send_lock:
            self._socket.send(self._codec.encode(message))

    def _install_signal_handlers(self) -> None:
        def on_signal(signum: int, frame: types.FrameType | None) -> None:
            if self._stop_requested.is_set():
                raise SystemExit(1)  # a second signal: exit at once
            self._log.info("worker.drain_requested", signal=signal.Signals(signum).name)
            self._stop_requested.set()
            if self._lifecycle.state is not State.READY:
                raise SystemExit(0)  # nothing in flight during start-up: stop at once

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _close(self) -> None:
        self._socket.close(linger=2000)
