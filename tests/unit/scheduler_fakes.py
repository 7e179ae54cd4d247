"""In-memory stand-ins for a gateway and for workers that drive a SchedulerCore through its public methods only.

`Sim` owns a core, a fake monotonic clock and the record of every message the core
has sent. `FakeWorker` plays one incarnation of a worker process: it sends hello,
lifecycle reports, heartbeats and step results, and it keeps a model of its KV pages,
the token each position of each page holds, so that every StepRequest is checked: a
sequence's pages before `start_position` hold tokens (its own, or a cached prefix's),
no two sequences write one page, and what the sequence reads there is recorded
(`tokens_of`) for tests to compare with its prompt. By default a page holds a whole
sequence (`kv_page_size` = max_model_len), so `num_kv_slots=N` gives N pages: N
sequences at once, as slots did. It verifies draft tokens greedily against what the test
says the target would produce. `FakeDraft` plays the draft service: it keeps the tokens
it holds per sequence and checks every propose request's counts against them.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

import msgspec

from common.trees import child_holding, parents_or_chain
from proto import messages as m
from proto.lifecycle import INIT_PHASES, State
from scheduler.config import SchedulerConfig
from scheduler.core import SchedulerCore
from scheduler.outbox import Outgoing

GATEWAY = b"gateway-1"
DEFAULT_TOKEN = 7  # what a fake worker samples when a test does not say
EOS = 2
FINGERPRINT = "fp-smol-1"
VOCAB = "vocab-smol"
FEATURE_WIDTH = 2  # a fake target's "final hidden state" at position p is [p, p] (float32)


def fake_features(start: int, count: int) -> m.FeatureRows:
    values = [float(p) for p in range(start, start + count) for _ in range(FEATURE_WIDTH)]
    return m.FeatureRows(start, count, FEATURE_WIDTH, "float32", struct.pack(f"<{len(values)}f", *values))


def fake_logprob(position: int, token: int, num_top: int) -> m.TokenLogprob:
    """A log-probability that says where it was computed: -position/100 for `token`, alternatives after it."""
    return m.TokenLogprob(-position / 100, [m.TopLogprob(token + i, -position / 100 - i) for i in range(num_top)])


def feature_positions(rows: m.FeatureRows) -> list[int]:
    values = struct.unpack(f"<{rows.num_rows * rows.width}f", rows.data)
    return [int(v) for v in values[:: rows.width]]


def make_config(**overrides: object) -> SchedulerConfig:
    config = SchedulerConfig(
        gateway_address="inproc://gateway",
        worker_address="inproc://workers",
        model_name="tiny-llama",
        max_model_len=64,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_queue_len=16,
        no_worker_timeout_s=10.0,
        heartbeat_timeout_s=5.0,
        step_timeout_s=30.0,
        # Most tests script what a draft proposes and how it is verified: every step that may speculate does. The
        # goodput policy's tests ask for it.
        speculation_policy="fixed",
    )
    return replace(config, **overrides)  # type: ignore[arg-type]


def prompt(n: int, first: int = 100) -> list[int]:
    """n distinct prompt tokens (never a stop token, never DEFAULT_TOKEN)."""
    return list(range(first, first + n))


class Sim:
    """A SchedulerCore, a clock, one gateway, and the log of everything the core sent."""

    def __init__(self, *, rng: random.Random | None = None, **config_overrides: object) -> None:
        self.config = make_config(**config_overrides)
        self.disconnected: set[bytes] = set()  # worker socket identities whose connection is gone
        self.wall_ns = 1_700_000_000 * 10**9  # the wall clock a hello's incarnation is checked against
        self.core = SchedulerCore(
            self.config,
            rng=rng or random.Random(0),
            wall_clock_ns=lambda: self.wall_ns,
            peer_connected=lambda identity: identity not in self.disconnected,
        )
        self.now_s = 100.0
        self.sent: list[Outgoing] = []
        self.gateway_heartbeats = True  # the gateway is alive: heard as time passes (False: silent, as if it hung)
        self.core.on_gateway_message(GATEWAY, m.GatewayHello("gateway-1", m.PROTOCOL_VERSION), self.now_s)
        self.collect()

    # ---------------------------------------------------------------- driving

    def collect(self) -> list[Outgoing]:
        """Move what the core put in its outbox into `sent`; returns just those."""
        new = self.core.outbox.take()
        self.sent.extend(new)
        return new

    def advance(self, seconds: float) -> None:
        self.now_s += seconds
        if self.gateway_heartbeats:  # one heartbeat at the end stands for the ones a second apart
            self.core.on_gateway_message(GATEWAY, m.GatewayHeartbeat("gateway-1", m.PROTOCOL_VERSION), self.now_s)
            self.collect()

    def check_timeouts(self) -> list[Outgoing]:
        self.core.check_timeouts(self.now_s)
        return self.collect()

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int] = (100, 101, 102),
        *,
        max_tokens: int | None = 4,
        stop_token_ids: Sequence[int] = (EOS,),
        sampling: m.SamplingParams | None = None,
        seed_given: bool = True,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        priority: int = 0,
        tenant: str = "",
    ) -> list[Outgoing]:
        submit = m.SubmitRequest(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            max_tokens=max_tokens,
            sampling=sampling or m.SamplingParams(),
            stop_token_ids=list(stop_token_ids),
            seed_given=seed_given,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            priority=priority,
            tenant=tenant,
        )
        self.core.on_gateway_message(GATEWAY, submit, self.now_s)
        return self.collect()

    def abort(self, request_id: str, reason: str = "client_cancelled") -> list[Outgoing]:
        self.core.on_gateway_message(GATEWAY, m.AbortRequest(request_id, reason), self.now_s)
        return self.collect()

    def info(self) -> m.InfoReply:
        return self.core.info(0, self.now_s)

    def process(self, worker_id: str) -> m.ProcessInfo:
        (found,) = [p for p in self.info().processes if p.process_id == worker_id]
        return found

    # ---------------------------------------------------------------- reading what went to the gateway

    def to_gateway(self, items: Sequence[Outgoing] | None = None) -> list[msgspec.Struct]:
        """Messages to the gateway in order, a TokenDeltas batch counted as its deltas."""
        messages: list[msgspec.Struct] = []
        for o in self.sent if items is None else items:
            if not o.to_worker:
                messages.extend(o.message.deltas if isinstance(o.message, m.TokenDeltas) else [o.message])
        return messages

    def deltas(self, request_id: str) -> list[m.TokenDelta]:
        return [g for g in self.to_gateway() if isinstance(g, m.TokenDelta) and g.request_id == request_id]

    def streamed(self, request_id: str) -> list[int]:
        return [t for d in self.deltas(request_id) for t in d.token_ids]

    def finish_reason(self, request_id: str) -> str | None:
        deltas = self.deltas(request_id)
        return deltas[-1].finish_reason if deltas else None

    def errors(self, request_id: str | None = None) -> list[m.RequestError]:
        return [g for g in self.to_gateway() if isinstance(g, m.RequestError) and request_id in (None, g.request_id)]

    def worker(self, worker_id: str = "w0", *, identity: bytes | None = None, **hello_overrides: object) -> FakeWorker:
        return FakeWorker(self, worker_id, identity=identity, **hello_overrides)

    def draft(self, worker_id: str = "d0", **hello_overrides: object) -> FakeDraft:
        return FakeDraft(self, worker_id, **hello_overrides)


class FakeWorker:
    """One incarnation of a worker process, talking to the core through on_worker_message."""

    def __init__(self, sim: Sim, worker_id: str, *, identity: bytes | None = None, **hello_overrides: object) -> None:
        self.sim = sim
        fields: dict[str, object] = dict(
            worker_id=worker_id,
            role="target",
            incarnation=1,
            protocol_version=m.PROTOCOL_VERSION,
            pid=4242,
            model_name=sim.config.model_name,
            model_fingerprint=FINGERPRINT,
            vocab_size=49152,
            max_model_len=sim.config.max_model_len,
            num_kv_pages=4,
            kv_page_size=sim.config.max_model_len,
            dtype="float32",
            device="cpu",
            vocab_fingerprint=VOCAB,
            max_draft_tokens=8,
            feature_width=FEATURE_WIDTH,
        )
        if "num_kv_slots" in hello_overrides:  # whole-sequence pages: N of them hold N sequences
            hello_overrides["num_kv_pages"] = hello_overrides.pop("num_kv_slots")
        fields.update(hello_overrides)
        self.hello_message = m.WorkerHello(**fields)  # type: ignore[arg-type]
        self.identity = identity or worker_id.encode()
        self.state = State.STARTING
        self.kv: dict[tuple[int, int], int] = {}  # (page, offset) -> the token whose keys and values it holds
        self.tokens_of: dict[str, list[int]] = {}  # each sequence as its latest step read and wrote it
        self.steps: list[m.StepRequest] = []
        self.drains: list[m.Drain] = []
        self._num_seen = 0
        self._answered_step_ids: set[int] = set()
        self.last_outputs: list[m.SeqOutput] = []
        self.returned: dict[str, list[int]] = {}  # request_id -> every token its steps' outputs returned, in order
        # What each step says it took (the scheduler fits its cost model to these): 3 ms whatever it computes, unless a
        # test says otherwise.
        self.step_ms: Callable[[m.StepRequest], float] = lambda step: 3.0
        self.warm_up_timings: list[m.StepTiming] = []  # what its READY report says its warm-up steps took

    @property
    def worker_id(self) -> str:
        return self.hello_message.worker_id

    @property
    def incarnation(self) -> int:
        return self.hello_message.incarnation

    # ---------------------------------------------------------------- sending

    def hello(self) -> bool:
        return self.send(self.hello_message)

    def report(self, state: State) -> bool:
        previous, self.state = self.state, state
        timings = self.warm_up_timings if state is State.READY else []
        return self.send(
            m.LifecycleReport(self.worker_id, self.incarnation, state, previous, 0.25, step_timings=timings)
        )

    def start(self, until: State = State.READY) -> FakeWorker:
        """Hello, then the lifecycle reports in order up to `until` (STARTING: hello only)."""
        assert self.hello(), f"{self.worker_id} incarnation {self.incarnation}: hello dropped"
        return self.boot(until)

    def boot(self, until: State = State.READY) -> FakeWorker:
        """The lifecycle reports from the current state up to `until`, each phase in order."""
        order = (*INIT_PHASES, State.READY)
        for state in order[order.index(self.state) + 1 : order.index(until) + 1]:
            self.report(state)
        return self

    def heartbeat(self, num_used_kv_pages: int = 0) -> bool:
        return self.send(m.Heartbeat(self.worker_id, self.incarnation, self.state, num_used_kv_pages, len(self.steps)))

    def fail(self, message: str = "CUDA error: device-side assert") -> bool:
        return self.send(m.WorkerFailed(self.worker_id, self.incarnation, self.state, "RuntimeError", message))

    def refuse_step(self) -> bool:
        step = self.pending_step()
        assert step is not None
        return self.send(m.StepRefused(self.worker_id, self.incarnation, step.step_id, self.state, "not READY"))

    def complete(
        self,
        tokens: Mapping[str, Sequence[int]] | None = None,
        *,
        step: m.StepRequest | None = None,
    ) -> bool:
        """Answer the pending step (or `step`) as a greedy target whose next tokens are tokens[request_id].

        A sequence without drafts returns the first of them (DEFAULT_TOKEN when none is
        given); one with drafts accepts the drafts that match them, then adds the next.
        """
        step = step or self.pending_step()
        assert step is not None, f"{self.worker_id} has no step to answer"
        self._answered_step_ids.add(step.step_id)
        tokens = tokens or {}
        outputs = []
        features = []
        scored = []
        for seq in step.seqs:
            num_standing = len(seq.token_ids) - seq.num_draft_tokens
            if seq.prompt_logprobs >= 0:  # like the real worker: each standing token's after the first, then the next
                following = list(seq.token_ids[1:num_standing]) + (
                    [seq.after_token_id] if seq.after_token_id >= 0 else []
                )
                scored.append(
                    m.PromptLogprobs(
                        seq.request_id,
                        seq.start_position + 1,
                        [
                            fake_logprob(seq.start_position + 1 + i, token, seq.prompt_logprobs)
                            for i, token in enumerate(following)
                        ],
                    )
                )
            if seq.sample:
                truth = list(tokens.get(seq.request_id, [])) or [DEFAULT_TOKEN]
                drafts = seq.token_ids[len(seq.token_ids) - seq.num_draft_tokens :] if seq.num_draft_tokens else []
                parents = parents_or_chain(seq.draft_parents, len(drafts))
                nodes: list[int] = []  # the branch of the drafts' tree (a chain's first ones) that matches the truth
                while len(nodes) + 1 < len(truth):
                    node = child_holding(parents, drafts, nodes[-1] if nodes else -1, truth[len(nodes)])
                    if node is None:
                        break
                    nodes.append(node)
                accepted = len(nodes)
                first = seq.start_position + num_standing
                logprobs = (
                    None
                    if seq.logprobs < 0
                    else [fake_logprob(first + i, token, seq.logprobs) for i, token in enumerate(truth[: accepted + 1])]
                )
                outputs.append(m.SeqOutput(seq.request_id, truth[: accepted + 1], nodes, logprobs))
                first = seq.start_position + num_standing
                for i, token in enumerate(truth[:accepted]):  # the accepted branch's keys and values, where they stand
                    self._write(seq, first + i, token)
                held = self.tokens_of[seq.request_id]
                del held[first:]
                held.extend(truth[:accepted])
                num_standing += accepted
            if step.return_features:  # like the real worker: every position of the step that stands
                features.append(m.SeqFeatures(seq.request_id, fake_features(seq.start_position, num_standing)))
        return self.send(
            m.StepResult(
                self.worker_id,
                self.incarnation,
                step.step_id,
                outputs,
                duration_ms=self.step_ms(step),
                features=features,
                prompt_logprobs=scored,
            )
        )

    def run(
        self, scripts: Mapping[str, Sequence[int]] | None = None, max_steps: int = 200, draft: FakeDraft | None = None
    ) -> int:
        """Answer steps (and, with a draft, proposals) until nothing is pending.

        Each request produces the next tokens of its script (then DEFAULT_TOKEN); drafts
        that match the script are accepted.
        """
        remaining = {rid: list(tokens) for rid, tokens in (scripts or {}).items()}
        for num_steps in range(max_steps):
            if draft is not None and draft.pending_propose() is not None:
                draft.answer()
            step = self.pending_step()
            if step is None:
                return num_steps
            truths = {
                s.request_id: remaining.get(s.request_id, [])[: s.num_draft_tokens + 1] for s in step.seqs if s.sample
            }
            self.complete(truths)
            for output in self.last_outputs:
                del remaining.get(output.request_id, [])[: len(output.token_ids)]
        raise AssertionError(f"still stepping after {max_steps} steps")

    def send(self, message: m.WorkerToScheduler) -> bool:
        if isinstance(message, m.StepResult):
            self.last_outputs = list(message.outputs)  # what run() consumes from the scripts
            for output in message.outputs:
                self.returned.setdefault(output.request_id, []).extend(output.token_ids)
        accepted = self.sim.core.on_worker_message(self.identity, message, self.sim.now_s)
        self.sim.collect()
        return accepted

    # ---------------------------------------------------------------- receiving

    def inbox(self) -> list[m.StepRequest | m.Drain]:
        """Every message the core sent to this incarnation, in order, applied to the KV model as it arrives."""
        new = self.sim.sent[self._num_seen :]
        self._num_seen = len(self.sim.sent)
        for item in new:
            message = item.message
            if not item.to_worker or item.identity != self.identity:
                continue
            assert isinstance(message, (m.StepRequest, m.Drain)), message
            if message.incarnation != self.incarnation:
                continue
            self._apply(message)
        return [*self.steps, *self.drains]

    def _apply(self, message: m.StepRequest | m.Drain) -> None:
        match message:
            case m.StepRequest():
                size = self.hello_message.kv_page_size
                written: dict[int, str] = {}
                for seq in message.seqs:
                    end = seq.start_position + len(seq.token_ids)
                    assert len(seq.pages) * size >= end, (
                        f"step {message.step_id}: {seq.request_id}'s pages end before {end}"
                    )
                    assert all(0 <= p < self.hello_message.num_kv_pages for p in seq.pages), seq.pages
                    for page in seq.pages[seq.start_position // size : -(-end // size)]:
                        assert written.setdefault(page, seq.request_id) == seq.request_id, (
                            f"step {message.step_id}: page {page} written by {written[page]} and {seq.request_id}"
                        )
                for seq in message.seqs:
                    read = []
                    for position in range(seq.start_position):
                        key = (seq.pages[position // size], position % size)
                        assert key in self.kv, (
                            f"step {message.step_id}: {seq.request_id} starts at "
                            f"{seq.start_position} but page {key[0]} holds nothing at {key[1]}"
                        )
                        read.append(self.kv[key])
                    for i, token in enumerate(seq.token_ids):
                        self._write(seq, seq.start_position + i, token)
                    self.tokens_of[seq.request_id] = read + list(seq.token_ids)
                self.steps.append(message)
            case m.Drain():
                self.drains.append(message)

    def _write(self, seq: m.SeqWork, position: int, token: int) -> None:
        size = self.hello_message.kv_page_size
        self.kv[seq.pages[position // size], position % size] = token

    def all_steps(self) -> list[m.StepRequest]:
        self.inbox()
        return list(self.steps)

    def pending_step(self) -> m.StepRequest | None:
        """The latest step sent here that this fake has not answered yet."""
        steps = self.all_steps()
        if steps and steps[-1].step_id not in self._answered_step_ids:
            return steps[-1]
        return None

    def step(self) -> m.StepRequest:
        """The pending step; fails the test when there is none."""
        step = self.pending_step()
        assert step is not None, f"{self.worker_id} has no pending step"
        return step

    def seqs_of(self, request_id: str) -> list[m.SeqWork]:
        return [s for step in self.all_steps() for s in step.seqs if s.request_id == request_id]

    def pages_of(self, request_id: str) -> list[int]:
        """The block table of the request's latest step."""
        return list(self.seqs_of(request_id)[-1].pages)


def assert_all_free(sim: Sim, *workers: FakeWorker) -> None:
    """Nothing queued or running, no process holds a request, and no sequence holds a page (the prefix cache may)."""
    info = sim.info()
    assert (info.num_waiting, info.num_running) == (0, 0)
    assert sim.core.num_waiting == 0 and sim.core.num_running == 0
    assert sim.core.num_speculation_states == 0  # each request's speculation state went with it
    assert [p.num_running for p in info.processes] == [0] * len(info.processes)
    live = {w.worker_id for w in workers}
    for process in info.processes:
        if process.process_id in live and process.role == "target" and process.state == "READY":
            assert process.num_used_kv_pages == process.num_cached_kv_pages, f"{process.process_id} still holds pages"


class FakeDraft(FakeWorker):
    """The draft service: holds each sequence's tokens, checks the counts of every propose request,
    and proposes what the test scripts (`script[request_id]`: the continuation it believes in)."""

    def __init__(self, sim: Sim, worker_id: str, **hello_overrides: object) -> None:
        fields: dict[str, object] = dict(
            role="draft", vocab_fingerprint="", vocab_size=0, num_kv_pages=0, max_draft_tokens=8, feature_width=0
        )
        fields.update(hello_overrides)
        super().__init__(sim, worker_id, **fields)
        self.held: dict[str, list[int]] = {}
        self.features: dict[str, list[int]] = {}  # a feature-reading draft: the positions whose features it holds
        self.proposes: list[m.ProposeRequest] = []
        self._forgotten: list[str] = []
        self.script: dict[str, list[int]] = {}  # request_id -> whole sequence the draft believes in
        self.strict = True  # a propose request whose counts disagree fails the test; else it restarts the sequence
        self.restarts: list[str] = []
        self._answered: set[int] = set()
        self._num_seen_draft = 0

    def draft_inbox(self) -> list[msgspec.Struct]:
        new = self.sim.sent[self._num_seen_draft :]
        self._num_seen_draft = len(self.sim.sent)
        for item in new:
            message = item.message
            if (
                not item.to_worker
                or item.identity != self.identity
                or getattr(message, "incarnation", None) != self.incarnation
            ):
                continue
            match message:
                case m.ProposeRequest():
                    self.proposes.append(message)
                case m.ReleaseSequences():
                    for rid in message.request_ids:
                        self.held.pop(rid, None)
                        self.features.pop(rid, None)
                        self._forgotten.append(rid)
                case m.Drain():
                    self.drains.append(message)
        return [*self.proposes, *self.drains]

    def forgotten(self) -> list[str]:
        """Request ids the scheduler told it to forget, in order."""
        self.draft_inbox()
        return list(self._forgotten)

    def pending_propose(self) -> m.ProposeRequest | None:
        self.draft_inbox()
        pending = [p for p in self.proposes if p.propose_id not in self._answered]
        return pending[-1] if pending else None

    def answer(
        self,
        proposals: Mapping[str, Sequence[int]] | None = None,
        parents: Mapping[str, list[int]] | None = None,
        chances: Mapping[str, list[float]] | None = None,
    ) -> bool:
        """Answer the pending propose request: the given tokens (as a tree with `parents` where given, with the
        draft's `chances` for them where given), else the script's continuation, else nothing."""
        request = self.pending_propose()
        assert request is not None, f"{self.worker_id} has no propose request"
        self._answered.add(request.propose_id)
        answers = []
        for seq in request.seqs:
            held = self.held.get(seq.request_id, [])
            have = self.features.get(seq.request_id, [])
            reads = self.hello_message.feature_width > 0
            if seq.num_held != len(held) or (
                reads and (seq.features is None or seq.features.start_position != len(have))
            ):
                assert not self.strict, f"{seq.request_id}: told it holds {seq.num_held}, holds {len(held)}"
                self.held.pop(seq.request_id, None)  # what the real service does: start the sequence over
                self.features.pop(seq.request_id, None)
                self.restarts.append(seq.request_id)
                answers.append(m.Proposal(seq.request_id, 0, []))
                continue
            tokens = held[: len(held) - seq.num_drop] + list(seq.new_token_ids)
            if reads:
                assert seq.features is not None
                have = have + feature_positions(seq.features)
                assert have == list(range(len(tokens) - 1)), (
                    f"{seq.request_id}: features of {have} for {len(tokens)} tokens"
                )
                self.features[seq.request_id] = have
            else:
                assert seq.features is None
            if proposals is not None and seq.request_id in proposals:
                proposal = list(proposals[seq.request_id])  # as given, even when longer than asked
            else:
                script = self.script.get(seq.request_id, [])
                proposal = script[len(tokens) : len(tokens) + seq.num_tokens] if script[: len(tokens)] == tokens else []
            self.held[seq.request_id] = tokens + proposal
            said = (chances or {}).get(seq.request_id)
            answers.append(
                m.Proposal(
                    seq.request_id,
                    len(tokens),
                    proposal,
                    parents=(parents or {}).get(seq.request_id),
                    source="suffix" if said is not None else "",
                    chances=None if said is None else said[: len(proposal)],
                )
            )
        return self.send(m.ProposeResult(self.worker_id, self.incarnation, request.propose_id, answers, 1.0))
