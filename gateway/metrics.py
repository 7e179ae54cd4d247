"""Prometheus metrics of the gateway: its own request figures, plus the scheduler's as of the latest InfoReply.

Request, token and latency figures are counted here as requests stream, and the messages
the gateway dropped as it reads them. Queue length, running requests, speculation
counters, each process's lifecycle state, kernels and dropped messages come from the
scheduler's InfoReply (the same message GetServerInfo and health use), fetched when
/metrics is scraped: no second channel to the scheduler.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from proto import messages
from proto.lifecycle import State

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "specserve_requests",
            "Finished requests by API and outcome (stop, length, abort, cancelled, or the error status)",
            ["api", "outcome"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "specserve_prompt_tokens", "Prompt tokens submitted", ["api"], registry=self.registry
        )
        self.generation_tokens = Counter(
            "specserve_generation_tokens", "Completion tokens sent to clients", ["api"], registry=self.registry
        )
        self.time_to_first_token = Histogram(
            "specserve_time_to_first_token_seconds",
            "From the request's arrival to its first token",
            ["api"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.inter_token_latency = Histogram(
            "specserve_inter_token_latency_seconds",
            "Between two tokens of a stream (a chunk's gap spread evenly over its tokens)",
            ["api"],
            buckets=_LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self._scheduler = SchedulerCollector()
        self.registry.register(self._scheduler)

    def observe_tokens(self, api: str, num_tokens: int, gap_s: float, *, first: bool) -> None:
        """A chunk of num_tokens arrived gap_s after the previous one (after the request's arrival if first)."""
        self.generation_tokens.labels(api).inc(num_tokens)
        if first:
            self.time_to_first_token.labels(api).observe(gap_s)
            num_tokens -= 1
            if num_tokens == 0:
                return
            gap_s = 0.0  # the first chunk's other tokens came with it
        for _ in range(num_tokens):
            self.inter_token_latency.labels(api).observe(gap_s / num_tokens)

    def exposition(self, info: messages.InfoReply | None, protocol_errors: Mapping[str, int] | None = None) -> bytes:
        """The text format, with the scheduler's figures from `info` (None: the scheduler did not answer) and the
        messages this gateway dropped, by kind."""
        self._scheduler.info = info
        self._scheduler.gateway_protocol_errors = dict(protocol_errors or {})
        return generate_latest(self.registry)


class SchedulerCollector(Collector):
    def __init__(self) -> None:
        self.info: messages.InfoReply | None = None
        self.gateway_protocol_errors: dict[str, int] = {}

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        info = self.info
        up = GaugeMetricFamily("specserve_scheduler_up", "1 when the scheduler answered this scrape")
        up.add_metric([], 0.0 if info is None else 1.0)
        yield up
        yield self._protocol_errors(info)
        if info is None:
            return
        yield GaugeMetricFamily("specserve_queue_length", "Requests waiting for KV pages", value=info.num_waiting)
        yield GaugeMetricFamily(
            "specserve_running_requests", "Requests placed on a worker (the running batch)", value=info.num_running
        )
        yield GaugeMetricFamily(
            "specserve_gateways",
            "Gateways the scheduler knows (connected, or missing for less than its --gateway-gone-grace-s)",
            value=info.num_gateways,
        )
        yield CounterMetricFamily(
            "specserve_gone_gateways",
            "Gateways the scheduler gave up on: missing for longer than its --gateway-gone-grace-s",
            value=info.num_gone_gateways,
        )
        yield CounterMetricFamily(
            "specserve_orphaned_requests",
            "Requests aborted because their gateway was gone",
            value=info.num_orphaned_requests,
        )
        state = GaugeMetricFamily(
            "specserve_process_state",
            "1 for each process's current lifecycle state",
            labels=["process_id", "role", "state"],
        )
        heartbeat = GaugeMetricFamily(
            "specserve_process_heartbeat_age_seconds",
            "Since each process was last heard",
            labels=["process_id", "role"],
        )
        kernels = GaugeMetricFamily(
            "specserve_process_kernels_info",
            "1, labelled with the kernels each process's model "
            "runs on, as it said when READY (none for a process that runs no model)",
            labels=["process_id", "role", "kernels"],
        )
        for process in info.processes:
            for name in State:
                state.add_metric(
                    [process.process_id, process.role, name.value], 1.0 if process.state == name.value else 0.0
                )
            heartbeat.add_metric([process.process_id, process.role], process.heartbeat_age_s)
            if process.kernels:
                kernels.add_metric([process.process_id, process.role, process.kernels], 1.0)
        yield state
        yield heartbeat
        yield kernels
        yield from _kv_cache_metrics(info.processes)
        spec = info.speculation
        if spec is None:
            return
        yield CounterMetricFamily(
            "specserve_draft_tokens", "Draft tokens sent to verification", value=spec.num_draft_tokens
        )
        yield CounterMetricFamily(
            "specserve_accepted_draft_tokens", "Draft tokens the target accepted", value=spec.num_accepted_draft_tokens
        )
        yield GaugeMetricFamily(
            "specserve_acceptance_rate", "Accepted / proposed draft tokens since start", value=spec.acceptance_rate
        )
        decisions = CounterMetricFamily(
            "specserve_speculation_decisions", "Steps by the k the scheduler chose (0: decoded plainly)", labels=["k"]
        )
        for k, count in sorted(spec.steps_by_k.items()):
            decisions.add_metric([str(k)], count)
        yield decisions
        for metric, counts, what in (
            (
                "specserve_spec_decode_num_drafts_per_pos",
                spec.proposed_by_position,
                "Verify steps that proposed a draft token at this position (0: the first; a tree's: its depth)",
            ),
            (
                "specserve_spec_decode_num_accepted_tokens_per_pos",
                spec.accepted_by_position,
                "Verify steps that accepted the draft token at this position (vLLM's name)",
            ),
        ):
            family = CounterMetricFamily(metric, what, labels=["position"])
            for position, count in sorted(counts.items()):
                family.add_metric([str(position)], count)
            yield family
        cost = GaugeMetricFamily(
            "specserve_propose_ms",
            "What a proposal costs lately (moving average): the draft "
            "service's own time (draft), from the propose request's sending to its answer "
            "(wait), and what waiting for it added to a target's idle time between a step's "
            "planning and its result (ask)",
            labels=["part"],
        )
        cost.add_metric(["draft"], spec.propose_ms)
        cost.add_metric(["wait"], spec.propose_wait_ms)
        cost.add_metric(["ask"], spec.ask_ms)
        yield cost
        yield from _source_metrics(spec)

    def _protocol_errors(self, info: messages.InfoReply | None) -> CounterMetricFamily:
        """Malformed, stale or unexpected messages each process dropped (the scheduler's by socket and kind)."""
        errors = CounterMetricFamily(
            "specserve_protocol_errors",
            "Messages a process dropped as malformed, stale or unexpected, by kind",
            labels=["process_id", "kind"],
        )
        reports = [("gateway", self.gateway_protocol_errors)]
        if info is not None:
            reports += [("scheduler", info.protocol_errors)] + [
                (p.process_id, p.protocol_errors) for p in info.processes
            ]
        for process_id, counts in reports:
            for kind, count in sorted(counts.items()):
                errors.add_metric([process_id, kind], count)
        return errors


def _source_metrics(spec: messages.SpeculationInfo) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Each proposer source's drafts, and its recent acceptance per position (what the policy starts requests from)."""
    drafts = CounterMetricFamily(
        "specserve_source_draft_tokens", "Draft tokens sent to verification, by proposer source", labels=["source"]
    )
    accepted = CounterMetricFamily(
        "specserve_source_accepted_draft_tokens", "Draft tokens accepted, by proposer source", labels=["source"]
    )
    rates = GaugeMetricFamily(
        "specserve_source_acceptance",
        "How often a draft token at this position is accepted "
        "given the ones before it were, over a source's recent verify steps",
        labels=["source", "position"],
    )
    for source, entry in sorted(spec.sources.items()):
        drafts.add_metric([source], entry.num_draft_tokens)
        accepted.add_metric([source], entry.num_accepted_draft_tokens)
        for position, rate in enumerate(entry.recent_rates):
            rates.add_metric([source, str(position)], rate)
    yield drafts
    yield accepted
    yield rates


def _kv_cache_metrics(processes: list[messages.ProcessInfo]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """Each process's KV pages, and each target's prefix cache and preemptions."""
    pages = GaugeMetricFamily(
        "specserve_kv_pages",
        "KV cache pages by use: used (held by sequences or kept by the "
        "prefix cache), cached (kept only by the prefix cache), free",
        labels=["process_id", "use"],
    )
    queried = CounterMetricFamily(
        "specserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", labels=["process_id"]
    )
    hits = CounterMetricFamily(
        "specserve_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache (not computed)",
        labels=["process_id"],
    )
    preempted = CounterMetricFamily(
        "specserve_preemptions", "Sequences preempted for lack of KV pages (recomputed later)", labels=["process_id"]
    )
    cost = GaugeMetricFamily(
        "specserve_step_cost",
        "A target's step time as the scheduler fits it: fixed_ms, "
        "ms_per_row (decode or verify, up to 8 a step; ms_per_row_9_32, ms_per_row_over_32: "
        "beyond), ms_per_constrained_row (more under a grammar), ms_per_prefill_token, ms_per_kilo_context (attended "
        "positions), error_ms (recent mean absolute error of the fit), predicted_ms and "
        "measured_ms (recent means of the steps' predicted and measured times)",
        labels=["process_id", "term"],
    )
    invariant = GaugeMetricFamily(
        "specserve_batch_invariant",
        "1 where a target's steps are batch invariant (greedy "
        "verification gives exactly plain decoding's answer), 0 where drafts are verified "
        "lossless in distribution",
        labels=["process_id"],
    )
    for process in processes:
        pid = process.process_id
        pages.add_metric([pid, "used"], process.num_used_kv_pages)
        pages.add_metric([pid, "cached"], process.num_cached_kv_pages)
        pages.add_metric([pid, "free"], process.num_kv_pages - process.num_used_kv_pages)
        if process.role == "target":
            queried.add_metric([pid], process.prefix_cache_queried_tokens)
            hits.add_metric([pid], process.prefix_cache_hit_tokens)
            preempted.add_metric([pid], process.num_preemptions)
            if process.batch_invariant is not None:
                invariant.add_metric([pid], int(process.batch_invariant))
            if process.num_costed_steps:
                slopes = dict(
                    zip(
                        ("ms_per_row", "ms_per_row_9_32", "ms_per_row_over_32"),
                        process.step_ms_per_row_by_range or [process.step_ms_per_row],
                    )
                )
                for term, value in (
                    ("fixed_ms", process.step_fixed_ms),
                    *slopes.items(),
                    ("ms_per_constrained_row", process.step_ms_per_constrained_row),
                    ("ms_per_prefill_token", process.step_ms_per_prefill_token),
                    ("ms_per_kilo_context", process.step_ms_per_kilo_context),
                    ("error_ms", process.step_cost_error_ms),
                    ("predicted_ms", process.step_predicted_ms),
                    ("measured_ms", process.step_measured_ms),
                ):
                    cost.add_metric([pid, term], value)
    yield pages
    yield queried
    yield hits
    yield preempted
    yield cost
    yield invariant
