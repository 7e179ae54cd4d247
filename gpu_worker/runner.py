"""Runs steps on one model replica: checks them against the KV slots, forwards, samples."""

from __future__ import annotations

import torch

from gpu_worker.config import WorkerConfig
from modeling.batch import SeqSpan, build_step_batch
from modeling.config import ModelConfig
from modeling.cpu_kernels import can_prepack, prepack_linears
from modeling.kv_cache import KVCache, SlotError, SlotTable
from modeling.llama import LlamaModel
from modeling.sampling import sample
from proto.messages import SamplingParams, SeqOutput, SeqWork


class SelfCheckFailed(RuntimeError):
    """The model gave inconsistent results on the worker's own start-up check."""


class ModelRunner:
    """The model, its KV cache and the slot table, built in phases by the worker."""

    def __init__(self, config: WorkerConfig, model_config: ModelConfig) -> None:
        self._config = config
        self._model_config = model_config
        self._device = torch.device(config.device)
        self._dtype = getattr(torch, config.dtype)
        self._model: LlamaModel | None = None
        self._cache: KVCache | None = None
        self._slots = SlotTable(config.num_kv_slots, config.max_model_len)

    @property
    def num_used_slots(self) -> int:
        return self._slots.num_used

    # ------------------------------------------------------------------ phases

    def load(self) -> None:
        model = LlamaModel(self._model_config)
        model.load_weights(self._config.model)
        model = model.to(device=self._device, dtype=self._dtype)
        if can_prepack(self._dtype, self._device):
            prepack_linears(model)
        model.set_rope_cache(self._config.max_model_len)
        model.eval()
        self._model = model

    def allocate(self) -> None:
        self._cache = KVCache(self._model_config, self._config.num_kv_slots, self._config.max_model_len, self._dtype, self._device)

    def warm_up(self) -> None:
        """Forward passes at the largest shapes the scheduler may send, then the self-check."""
        cfg = self._config
        prompt_len = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        self._forward([SeqSpan(0, 0, [0] * prompt_len, 1)])
        num_verify = min(cfg.max_draft_tokens + 1, cfg.max_model_len - 1)
        self._forward([SeqSpan(slot, 0, [0], 1) for slot in range(cfg.num_kv_slots)])
        self._forward([SeqSpan(slot, 1, [0] * num_verify, num_verify) for slot in range(cfg.num_kv_slots)])
        self._self_check()

    def _self_check(self) -> None:
        """Prefilling a prompt at once and token by token must give the same next-token logits."""
        prompt = [(7 * i + 3) % self._model_config.vocab_size for i in range(12)]
        whole = self._forward([SeqSpan(0, 0, prompt, 1)])
        self._forward([SeqSpan(1, 0, prompt[:4], 0)])
        for position in range(4, len(prompt)):
            stepped = self._forward([SeqSpan(1, position, [prompt[position]], 1)])
        if not torch.isfinite(whole).all():
            raise SelfCheckFailed("the model produced non-finite logits")
        # Different batch shapes round differently; a broken cache is off by the logits' own scale.
        relative = 1e-4 if self._dtype == torch.float32 else 0.04
        tolerance = relative * float(whole.abs().max())
        gap = float((whole - stepped).abs().max())
        if gap > tolerance:
            raise SelfCheckFailed(f"prefill and step-by-step logits differ by {gap:.4g} (> {tolerance})")

    # ------------------------------------------------------------------ serving

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self._slots.release(slot)

    def execute(self, seqs: list[SeqWork]) -> list[SeqOutput]:
        """Run one step; raises SlotError, before touching any state, if it is inconsistent."""
        self._check(seqs)
        spans = [SeqSpan(w.slot, w.start_position, w.token_ids, 1 if w.sample else 0) for w in seqs]
        logits = self._forward(spans)  # [M, V], one row per sampled sequence
        sampled = [w for w in seqs if w.sample]
        params: list[SamplingParams] = [w.sampling for w in sampled]
        new_tokens = sample(logits, list(params), [w.start_position + len(w.token_ids) for w in sampled])
        for w in seqs:
            self._slots.set_length(w.slot, w.start_position + len(w.token_ids))
        return [SeqOutput(request_id=w.request_id, token_ids=[t]) for w, t in zip(sampled, new_tokens)]

    def _check(self, seqs: list[SeqWork]) -> None:
        seen: set[int] = set()
        vocab = self._model_config.vocab_size
        for w in seqs:
            if w.slot in seen:
                raise SlotError(f"slot {w.slot} appears twice in one step")
            seen.add(w.slot)
            self._slots.check_append(w.slot, w.start_position, len(w.token_ids))
            if any(not 0 <= t < vocab for t in w.token_ids):
                raise SlotError(f"request {w.request_id}: a token id is outside the vocabulary 0..{vocab - 1}")

    def _forward(self, spans: list[SeqSpan]) -> torch.Tensor:
        if self._model is None or self._cache is None:
            raise RuntimeError("the runner is not built: load() and allocate() come first")
        with torch.inference_mode():
            batch = build_step_batch(spans, self._device)
            return self._model.logits(self._model(batch, self._cache))
