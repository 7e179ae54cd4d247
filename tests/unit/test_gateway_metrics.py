"""Gateway metrics: token counts and latency histograms as chunks arrive; the scheduler's figures from an InfoReply."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import GatewayMetrics
from proto import messages as m
from proto.lifecycle import State


def samples(text: bytes) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text.decode())
        for s in family.samples
    }


def test_chunks_count_tokens_first_token_latency_and_spread_gaps() -> None:
    metrics = GatewayMetrics()
    metrics.observe_tokens("http", 1, 0.5, first=True)  # first token after 0.5 s
    metrics.observe_tokens("http", 4, 0.2, first=False)  # four tokens 0.2 s later: 0.05 s each
    got = samples(metrics.exposition(None))
    assert got[("specserve_generation_tokens_total", (("api", "http"),))] == 5
    assert got[("specserve_time_to_first_token_seconds_count", (("api", "http"),))] == 1
    assert got[("specserve_time_to_first_token_seconds_sum", (("api", "http"),))] == 0.5
    assert got[("specserve_inter_token_latency_seconds_count", (("api", "http"),))] == 4
    assert abs(got[("specserve_inter_token_latency_seconds_sum", (("api", "http"),))] - 0.2) < 1e-9
    assert got[("specserve_scheduler_up", ())] == 0  # no InfoReply: only that is said about the scheduler


def test_scheduler_figures_come_from_the_info_reply() -> None:
    info = m.InfoReply(
        1,
        "model",
        2048,
        num_waiting=3,
        num_running=5,
        processes=[
            m.ProcessInfo(
                "worker-0",
                "target",
                State.READY,
                1,
                0.2,
                6,
                8,
                16,
                5,
                "",
                num_cached_kv_pages=2,
                prefix_cache_queried_tokens=100,
                prefix_cache_hit_tokens=64,
                num_preemptions=3,
                kernels="native (linear kernel: avx2)",
                num_costed_steps=40,
                step_fixed_ms=9.5,
                step_ms_per_row=0.5,
                step_cost_error_ms=0.25,
                batch_invariant=False,
                step_predicted_ms=10.5,
                step_measured_ms=11.0,
            ),
            m.ProcessInfo("draft-0", "draft", State.FAILED, 1, 4.0, 0, 64, 16, 0, "LOADING: OSError"),
        ],
        speculation=m.SpeculationInfo(
            10,
            4,
            3,
            20,
            0.4,
            4 / 3,
            {0: 20, 6: 3},
            proposed_by_position={0: 3, 1: 3},
            accepted_by_position={0: 2, 1: 1},
            propose_ms=1.5,
            propose_wait_ms=2.5,
            sources={"lookup": m.SourceAcceptance(2, 8, 6, [0.75, 0.5])},
            policy="goodput",
        ),
    )
    got = samples(GatewayMetrics().exposition(info))
    worker = (("process_id", "worker-0"),)
    assert [got[("specserve_kv_pages", (*worker, ("use", use)))] for use in ("used", "cached", "free")] == [6, 2, 2]
    assert got[("specserve_prefix_cache_queried_tokens_total", worker)] == 100
    assert got[("specserve_prefix_cache_hit_tokens_total", worker)] == 64
    assert got[("specserve_preemptions_total", worker)] == 3
    assert got[("specserve_queue_length", ())] == 3 and got[("specserve_running_requests", ())] == 5
    assert got[("specserve_process_state", (("process_id", "draft-0"), ("role", "draft"), ("state", "FAILED")))] == 1
    assert got[("specserve_process_state", (("process_id", "draft-0"), ("role", "draft"), ("state", "READY")))] == 0
    kernels = [(labels, value) for (name, labels), value in got.items() if name == "specserve_process_kernels_info"]
    assert kernels == [
        ((("kernels", "native (linear kernel: avx2)"), *worker, ("role", "target")), 1)
    ]  # none for the draft
    assert got[("specserve_draft_tokens_total", ())] == 10 and got[("specserve_accepted_draft_tokens_total", ())] == 4
    assert got[("specserve_acceptance_rate", ())] == 0.4
    assert got[("specserve_speculation_decisions_total", (("k", "6"),))] == 3
    assert got[("specserve_spec_decode_num_drafts_per_pos_total", (("position", "1"),))] == 3
    assert got[("specserve_spec_decode_num_accepted_tokens_per_pos_total", (("position", "0"),))] == 2
    assert got[("specserve_step_cost", (*worker, ("term", "fixed_ms")))] == 9.5
    assert got[("specserve_propose_ms", (("part", "draft"),))] == 1.5
    assert got[("specserve_propose_ms", (("part", "wait"),))] == 2.5
    assert got[("specserve_step_cost", (*worker, ("term", "error_ms")))] == 0.25
    assert ("specserve_step_cost", (("process_id", "draft-0"), ("term", "fixed_ms"))) not in got
    assert got[("specserve_step_cost", (*worker, ("term", "predicted_ms")))] == 10.5
    assert got[("specserve_step_cost", (*worker, ("term", "measured_ms")))] == 11.0
    assert got[("specserve_batch_invariant", worker)] == 0
    assert ("specserve_batch_invariant", (("process_id", "draft-0"),)) not in got  # a draft says nothing of it
    assert got[("specserve_source_draft_tokens_total", (("source", "lookup"),))] == 8
    assert got[("specserve_source_accepted_draft_tokens_total", (("source", "lookup"),))] == 6
    assert got[("specserve_source_acceptance", (("position", "1"), ("source", "lookup")))] == 0.5


def test_every_process_dropped_message_is_exported_by_process_and_kind() -> None:
    info = m.InfoReply(
        1,
        "model",
        2048,
        num_waiting=0,
        num_running=0,
        processes=[
            m.ProcessInfo("worker-0", "target", State.READY, 1, 0.2, 2, 8, 16, 5, "", protocol_errors={"decode": 2}),
        ],
        protocol_errors={"worker.stale_or_unexpected": 3, "gateway.decode": 1},
    )
    got = samples(GatewayMetrics().exposition(info, {"frames": 4}))
    errors = "specserve_protocol_errors_total"
    assert got[(errors, (("kind", "frames"), ("process_id", "gateway")))] == 4
    assert got[(errors, (("kind", "worker.stale_or_unexpected"), ("process_id", "scheduler")))] == 3
    assert got[(errors, (("kind", "gateway.decode"), ("process_id", "scheduler")))] == 1
    assert got[(errors, (("kind", "decode"), ("process_id", "worker-0")))] == 2
    got = samples(GatewayMetrics().exposition(None, {"decode": 1}))  # the gateway's own, even with no scheduler
    assert got[(errors, (("kind", "decode"), ("process_id", "gateway")))] == 1
