"""The draft service process: one proposer behind the lifecycle; answers batched propose requests."""

from __future__ import annotations

import os
import time
from typing import assert_never

import torch

from common.draft_spec import DraftKind
from common.lifecycle_process import LifecycleProcess, Phase, ReadyDetails
from draft_service.config import DraftConfig
from draft_service.head_proposer import EagleProposer
from draft_service.lookup_then_head import LookupThenHead
from draft_service.model_proposer import ModelProposer
from draft_service.phrase_proposer import PhraseProposer
from draft_service.prompt_lookup import NgramProposer
from draft_service.proposer import ProposeInput, Proposer
from draft_service.sequences import SequenceStore
from draft_service.suffix_proposer import SuffixProposer
from draft_service.testing_proposers import RandomProposer, ReplayProposer
from draft_service.traffic import TrafficDrafts
from modeling.kernels.packing import native_unavailable
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE
from common.text.phrases import FULL_CONTEXT as PHRASE_FULL_CONTEXT
from proto import frames
from proto import messages as m
from modeling.kernels.threads import compute_on
from proto.lifecycle import State

_ANY_VOCABULARY = 1 << 24  # token ids a store keeps where the target's vocabulary is not known to it


def traffic(config: DraftConfig, vocab_size: int) -> TrafficDrafts:
    """The suffix store of served text the proposer drafts from (a vocabulary of 0: the target's, as far as the
    protocol goes)."""
    return TrafficDrafts(config.suffix_cache_tokens, vocab_size or _ANY_VOCABULARY, config.suffix_scope)


def traffic_of(proposer: Proposer | None) -> TrafficDrafts | None:
    """The served text a proposer drafts from, where it keeps any."""
    served = getattr(proposer, "traffic", None)
    return served if isinstance(served, TrafficDrafts) and served.keeps_text else None


def learns_from_traffic(proposer: Proposer | None) -> bool:
    """Whether the scheduler should send it the text served (m.RecordText)."""
    return traffic_of(proposer) is not None


def make_proposer(config: DraftConfig) -> Proposer:
    spec = config.proposer
    path = spec.path  # DraftSpec.parse gives every kind but ngram and random its path
    prompt_lookup = NgramProposer(config.ngram_min, config.ngram_max)
    match spec.kind:
        case DraftKind.NGRAM:
            return prompt_lookup
        case DraftKind.SUFFIX:
            return SuffixProposer(traffic(config, 0), prompt_lookup, trees=config.token_trees)
        case DraftKind.PHRASES:
            assert path is not None and config.target_model is not None  # checked with the arguments
            phrases = PhraseProposer(path, config.target_model, prompt_lookup, trees=config.token_trees)
            if config.suffix_cache_tokens > 0:
                phrases.traffic = traffic(config, phrases.vocab_size)
            return phrases
        case DraftKind.EAGLE | DraftKind.EAGLE_NGRAM | DraftKind.EAGLE_PHRASES:
            assert path is not None and config.target_model is not None  # checked with the arguments
            head = EagleProposer(
                path,
                config.target_model,
                device=config.process.device,
                dtype=config.process.dtype,
                num_seqs=config.num_seqs,
                max_len=config.max_model_len,
                max_draft_tokens=config.max_draft_tokens,
                draft_top_k=config.draft_top_k,
            )
            if spec.kind is DraftKind.EAGLE:
                return head
            if spec.kind is DraftKind.EAGLE_NGRAM:
                return LookupThenHead(head, prompt_lookup, config.head_draft_tokens)
            phrases = PhraseProposer(path, config.target_model, prompt_lookup, min_context=PHRASE_FULL_CONTEXT)
            return LookupThenHead(head, phrases, config.head_draft_tokens)
        case DraftKind.MODEL:
            assert path is not None  # checked with the arguments
            return ModelProposer(
                path,
                device=config.process.device,
                dtype=config.process.dtype,
                num_seqs=config.num_seqs,
                max_len=config.max_model_len,
                max_draft_tokens=config.max_draft_tokens,
                draft_top_k=config.draft_top_k,
                quantization=config.quantization,
            )
        case DraftKind.RANDOM:
            assert spec.vocab_size is not None  # checked with the arguments
            return RandomProposer(spec.vocab_size)
        case DraftKind.REPLAY:
            assert path is not None  # checked with the arguments
            return ReplayProposer(path)
        case _:
            assert_never(spec.kind)


class DraftService(LifecycleProcess[m.SchedulerToDraft]):
    def __init__(self, config: DraftConfig) -> None:
        super().__init__(config.process, inbound=m.SchedulerToDraft)
        self._config = config
        self._sequences = SequenceStore()
        self._proposer: Proposer | None = None

    def hello(self) -> m.WorkerHello:
        cfg = self._config
        self._proposer = make_proposer(cfg)
        model = cfg.proposer.model_path
        runs_model = cfg.proposer.runs_model
        return m.WorkerHello(
            worker_id=cfg.process.worker_id,
            role="draft",
            incarnation=self.incarnation,
            protocol_version=m.PROTOCOL_VERSION,
            pid=os.getpid(),
            model_name=model.name if model else str(cfg.proposer),
            model_fingerprint="",
            vocab_size=self._proposer.vocab_size,
            max_model_len=cfg.max_model_len,
            num_kv_pages=self._proposer.num_kv_pages,
            kv_page_size=DEFAULT_PAGE_SIZE,
            dtype=cfg.process.dtype if runs_model else "",
            device=cfg.process.device if runs_model else "",
            vocab_fingerprint=self._proposer.vocab_fingerprint,
            max_draft_tokens=cfg.max_draft_tokens,
            feature_width=self._proposer.feature_width,
            target_fingerprint=self._proposer.target_fingerprint,
            draft_kind=cfg.proposer.kind.value,
            learns_from_traffic=learns_from_traffic(self._proposer),
        )

    def phases(self) -> list[Phase]:
        process = self._config.process
        on_cpu = process.device == "cpu"
        threads = process.compute_threads()
        if threads > 0:
            torch.set_num_threads(threads)
        assert self._proposer is not None  # made by hello()
        load_proposer, allocate, warm_up = self._proposer.phases()

        def load() -> None:
            load_proposer()
            if on_cpu and self._config.proposer.runs_model:
                compute_on(
                    threads, native=native_unavailable(getattr(torch, process.dtype), torch.device("cpu")) is None
                )

        return [(State.LOADING, load), (State.ALLOCATING, allocate), (State.WARMING, warm_up)]

    def max_frame_bytes(self) -> int:
        """A propose request at its largest: the sequences it holds (--num-seqs for each target), each sent whole with
        its feature rows (the scheduler asks for fewer, up to its --spec-disable-batch-threshold)."""
        cfg = self._config
        width = self._proposer.feature_width if self._proposer is not None else 0  # None: its hello failed
        return frames.scheduler_to_draft(
            frames.FrameLimits(
                max_model_len=cfg.max_model_len,
                max_num_seqs=cfg.num_seqs,
                max_num_batched_tokens=0,
                max_draft_tokens=cfg.max_draft_tokens,
                max_propose_seqs=cfg.num_seqs,
                feature_width=width,
            )
        )

    def num_used_kv_pages(self) -> int:
        """The draft KV pages its proposer holds (a lookup proposer holds none, whatever sequences it keeps)."""
        return self._proposer.num_used_kv_pages if self._proposer is not None else 0

    def ready_details(self) -> ReadyDetails:
        """The kernels of the proposer's draft model or head ("" for a lookup, which runs none)."""
        return ReadyDetails(kernels=self._proposer.kernels if self._proposer is not None else "")

    def handle(self, message: m.SchedulerToDraft) -> None:
        match message:
            case m.ProposeRequest():
                self._handle_propose(message)
            case m.ReleaseSequences():
                if message.incarnation != self.incarnation:
                    self.errors.record("stale_incarnation", message="release_seqs", incarnation=message.incarnation)
                    return
                for request_id in message.request_ids:
                    self._forget(request_id)
            case m.RecordText():
                if message.incarnation != self.incarnation:
                    self.errors.record("stale_incarnation", message="record_text", incarnation=message.incarnation)
                    return
                if (served := traffic_of(self._proposer)) is not None:
                    try:
                        served.record(message.tenant, message.token_ids)
                    except ValueError as exc:  # a token outside the vocabulary: the text is dropped, not the process
                        self.errors.record("bad_text", problem=str(exc))
            case m.Drain() | m.Probe():  # LifecycleProcess answers these itself and never passes them here
                self.errors.record("unexpected_message", message=type(message).__name__)
            case _:
                assert_never(message)

    def _forget(self, request_id: str) -> None:
        self._sequences.forget(request_id)
        if self._proposer is not None:
            self._proposer.forget(request_id)

    def _handle_propose(self, request: m.ProposeRequest) -> None:
        if request.incarnation != self.incarnation:  # meant for an earlier run of this service: it is gone
            self.errors.record("stale_incarnation", message="propose", incarnation=request.incarnation)
            return
        problem = self._problem(request)
        if problem:
            self.log.warning("propose.refused", propose_id=request.propose_id, reason=problem)
            self.send(
                m.ProposeRefused(
                    worker_id=self.process_id,
                    incarnation=self.incarnation,
                    propose_id=request.propose_id,
                    state=self.state,
                    reason=problem[: m.MAX_REASON_CHARS],
                )
            )
            return
        self.run_step(lambda: self._propose(request))

    def _propose(self, request: m.ProposeRequest) -> None:
        assert self._proposer is not None  # READY
        started = time.perf_counter()
        inputs: list[ProposeInput] = []
        num_held: dict[str, int] = {}
        for seq in request.seqs:
            update = self._sequences.update(seq) if self._consistent(seq) else None
            if update is None or update.restarted or not update.token_ids:  # nothing to continue: start over
                self._sequences.forget(seq.request_id)
                self._proposer.forget(seq.request_id)
                self.log.warning("propose.sequence_restarted", request_id=seq.request_id, expected=seq.num_held)
                continue
            num_held[seq.request_id] = len(update.token_ids)
            num_tokens = min(
                seq.num_tokens, self._config.max_draft_tokens, self._config.max_model_len - len(update.token_ids)
            )
            if num_tokens > 0:
                inputs.append(
                    ProposeInput(
                        seq.request_id,
                        update.token_ids,
                        update.num_stable,
                        num_tokens,
                        seq.sampling,
                        update.features,
                        seq.tenant,
                    )
                )
        proposed = dict(zip((i.request_id for i in inputs), self._proposer.propose(inputs)))
        proposals = []
        for seq in request.seqs:
            made = proposed.get(seq.request_id)
            tokens = made.token_ids if made else []
            if seq.request_id in num_held:
                self._sequences.record_proposal(seq.request_id, tokens)
            proposals.append(
                m.Proposal(
                    seq.request_id,
                    num_held.get(seq.request_id, 0),
                    tokens,
                    made.dists if made else None,
                    made.parents if made else None,
                    made.source[: m.MAX_NAME_CHARS] if made else "",
                    made.chances if made else None,
                )
            )
        self.num_steps += 1
        self.send(
            m.ProposeResult(
                worker_id=self.process_id,
                incarnation=self.incarnation,
                propose_id=request.propose_id,
                proposals=proposals,
                duration_ms=(time.perf_counter() - started) * 1000,
            )
        )

    def _problem(self, request: m.ProposeRequest) -> str:
        if self.state is not State.READY or self._proposer is None:
            return f"not READY (state {self.state})"
        ids = [seq.request_id for seq in request.seqs]
        if len(set(ids)) != len(ids):
            return "a sequence appears twice in one propose request"
        return ""

    def _consistent(self, seq: m.ProposeSeq) -> bool:
        """A sequence this service can take as given; any other starts over (the scheduler then resends it whole)."""
        vocab = self._proposer.vocab_size if self._proposer else 0
        if seq.num_tokens < 1 or seq.num_held < 0 or seq.num_drop < 0:
            return False
        if seq.features is not None and seq.features.start_position < 0:
            return False
        return not (vocab and any(not 0 <= t < vocab for t in seq.new_token_ids))
