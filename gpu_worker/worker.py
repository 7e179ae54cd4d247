"""The target worker process: phased start-up under the lifecycle, then a synchronous step loop."""

from __future__ import annotations

import os
import time
from typing import assert_never

import torch

from common.lifecycle_process import LifecycleProcess, Phase, ReadyDetails
from gpu_worker.config import WorkerConfig
from gpu_worker.runner import ModelRunner
from modeling.model.config import ModelConfig, model_fingerprint, vocab_fingerprint
from gpu_worker.memory import num_kv_pages
from modeling.model.batch import PageError
from modeling.model.graphs import CaptureFailed, CudaGraphBackend, GraphBackend, RecordingBackend
from modeling.kernels.threads import compute_on
from proto import frames
from proto import messages as m
from proto.lifecycle import State


class Worker(LifecycleProcess[m.SchedulerToWorker]):
    """One target model replica."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config.process, inbound=m.SchedulerToWorker)
        self._config = config
        self._runner: ModelRunner | None = None  # set once READY
        self._ready = ReadyDetails()  # what warming up found

    def hello(self) -> m.WorkerHello:
        cfg = self._config
        self._model_config = ModelConfig.from_folder(cfg.model)
        if cfg.max_model_len > self._model_config.max_position_embeddings:
            raise ValueError(
                f"--max-model-len {cfg.max_model_len} exceeds the model's "
                f"{self._model_config.max_position_embeddings} positions"
            )
        self._num_pages, budget = num_kv_pages(cfg, self._model_config)
        self.log.info("kv_cache.sized", num_pages=self._num_pages, page_size=cfg.page_size, budget=budget)
        return m.WorkerHello(
            worker_id=cfg.process.worker_id,
            role="target",
            incarnation=self.incarnation,
            protocol_version=m.PROTOCOL_VERSION,
            pid=os.getpid(),
            model_name=cfg.model.name,
            model_fingerprint=model_fingerprint(cfg.model),
            vocab_size=self._model_config.vocab_size,
            max_model_len=cfg.max_model_len,
            num_kv_pages=self._num_pages,
            kv_page_size=cfg.page_size,
            dtype=cfg.process.dtype,
            device=cfg.process.device,
            vocab_fingerprint=vocab_fingerprint(cfg.model),
            max_draft_tokens=cfg.max_draft_tokens,
            feature_width=self._model_config.hidden_size,
        )

    def max_frame_bytes(self) -> int:
        """A step at its largest, as this worker's settings allow (the scheduler's of the same names are no larger)."""
        cfg = self._config
        return frames.scheduler_to_target(
            frames.FrameLimits(
                max_model_len=cfg.max_model_len,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                max_draft_tokens=cfg.max_draft_tokens,
                kv_page_size=cfg.page_size,
            )
        )

    def phases(self) -> list[Phase]:
        process = self._config.process
        on_cpu = process.device == "cpu"
        threads = process.compute_threads()
        if threads > 0:
            torch.set_num_threads(threads)  # loading: torch's ops on every thread
        runner = ModelRunner(self._config, self._model_config, self._num_pages)

        def load() -> None:
            runner.load()
            if on_cpu:
                compute_on(threads, native=runner.native)
            self.log.info("model.loaded", ops=runner.ops, num_threads=threads)

        def warm_up() -> None:
            problem, timings = runner.warm_up()
            invariant = problem is None
            max_draft_tokens = None
            if not invariant:
                if self._config.require_batch_invariance:
                    max_draft_tokens = 0
                    self.log.warning(
                        "speculation.off",
                        reason=f"steps are not batch invariant: {problem}",
                        note="--require-batch-invariance: this worker serves without drafts",
                    )
                else:
                    self.log.warning(
                        "steps.not_batch_invariant",
                        reason=problem,
                        note="drafts are verified lossless in distribution; a greedy answer may differ "
                        "from plain decoding's where two logits are within rounding",
                    )
            self._ready = ReadyDetails(
                max_draft_tokens=max_draft_tokens,
                kernels=runner.ops,
                batch_invariant=invariant,
                step_timings=timings,
                graphs=self._capture(runner),
            )
            self.log.info(
                "steps.timed",
                batch_invariant=invariant,
                timings=[(t.decode_rows, round(t.duration_ms, 2)) for t in timings],
            )
            self._runner = runner

        return [(State.LOADING, load), (State.ALLOCATING, runner.allocate), (State.WARMING, warm_up)]

    def _capture(self, runner: ModelRunner) -> str:
        """The graphs' capture, the last part of WARMING (under its deadline): what the READY report says of them.
        Raises CaptureFailed unless --cuda-graphs fallback, which serves eagerly instead and says why."""
        mode, device = self._config.cuda_graphs, self._config.process.device
        if mode == "off":
            return "off"
        backend: GraphBackend = (
            CudaGraphBackend(torch.device(device)) if device.startswith("cuda") else RecordingBackend()
        )
        self.log.info("graphs.capturing", backend=backend.name)
        faults = self.faults
        try:
            count, seconds = runner.capture_graphs(backend, faults.at_capture if faults is not None else _nothing)
        except CaptureFailed as error:
            if mode != "fallback":
                raise
            self.log.warning("graphs.fallback", reason=str(error), note="--cuda-graphs fallback: serving eagerly")
            return f"fallback: eager ({error})"
        summary = (
            f"{count} graphs ({backend.name}), {backend.pool_bytes() / 2**20:.0f} MiB pool, captured in {seconds:.1f} s"
        )
        self.log.info("graphs.captured", graphs=summary)
        return summary

    def ready_details(self) -> ReadyDetails:
        return self._ready

    def handle(self, message: m.SchedulerToWorker) -> None:
        match message:
            case m.StepRequest():
                self._handle_step(message)
            case m.Drain() | m.Probe():  # LifecycleProcess answers these itself and never passes them here
                self.errors.record("unexpected_message", message=type(message).__name__)
            case _:
                assert_never(message)

    def _handle_step(self, step: m.StepRequest) -> None:
        if step.incarnation != self.incarnation:  # meant for an earlier run of this worker: that one is gone
            self.errors.record("stale_incarnation", message="step", incarnation=step.incarnation)
            return
        state = self.state
        if not self.runs_work or self._runner is None:
            self._refuse(step, f"not READY (state {state})")
            return
        runner = self._runner
        started = time.perf_counter()
        outputs: list[m.SeqOutput] = []
        features: list[m.SeqFeatures] = []
        prompt_logprobs: list[m.PromptLogprobs] = []

        def execute() -> None:
            done, rows, scored = runner.execute(step.seqs, step.return_features)
            outputs.extend(done)
            features.extend(rows)
            prompt_logprobs.extend(scored)

        try:
            self.run_step(execute)
        except PageError as exc:
            self._refuse(step, str(exc), exc.request_id)
            return
        self.num_steps += 1
        duration_ms = (time.perf_counter() - started) * 1000
        for work in step.seqs:
            if work.start_position == 0:  # one line per request on this worker, so a grep finds it here too
                self.log.info(
                    "seq.started", request_id=work.request_id, num_pages=len(work.pages), step_id=step.step_id
                )
        self.send(
            m.StepResult(
                worker_id=self.process_id,
                incarnation=self.incarnation,
                step_id=step.step_id,
                outputs=outputs,
                duration_ms=duration_ms,
                features=features,
                prompt_logprobs=prompt_logprobs,
            )
        )
        self.log.debug(
            "step.done",
            step_id=step.step_id,
            num_seqs=len(step.seqs),
            num_tokens=sum(len(work.token_ids) for work in step.seqs),
            duration_ms=round(duration_ms, 2),
            request_ids=[w.request_id for w in step.seqs],
        )

    def _refuse(self, step: m.StepRequest, reason: str, request_id: str = "") -> None:
        self.log.warning("step.refused", step_id=step.step_id, reason=reason, request_id=request_id)
        self.send(
            m.StepRefused(
                worker_id=self.process_id,
                incarnation=self.incarnation,
                step_id=step.step_id,
                state=self.state,
                reason=reason[: m.MAX_REASON_CHARS],
                request_id=request_id,
            )
        )


def _nothing(number: int) -> None:
    """No fault to inject."""
