"""What a stack's speculation counters moved by over a stretch of requests:
GetServerInfo's, and the steps by k on /metrics."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass

from proto import specserve_pb2 as pb

STEPS_BY_K_METRIC = "specserve_speculation_decisions"  # /metrics: target steps by the k chosen (0: decoded plainly)


@dataclass(frozen=True)
class SpeculationDelta:
    """What the server's speculation counters moved by over one cell."""

    num_draft_tokens: int
    num_accepted_draft_tokens: int
    num_verify_steps: int
    num_plain_decode_steps: int
    by_source: dict[str, tuple[int, int]]  # source -> (draft tokens, accepted draft tokens)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_accepted_draft_tokens / self.num_verify_steps if self.num_verify_steps else 0.0


def speculation_delta(before: pb.Speculation, after: pb.Speculation) -> SpeculationDelta:
    earlier = {s.source: s for s in before.sources}
    by_source = {}
    for source in after.sources:
        old = earlier.get(source.source)
        drafted = source.num_draft_tokens - (old.num_draft_tokens if old else 0)
        accepted = source.num_accepted_draft_tokens - (old.num_accepted_draft_tokens if old else 0)
        if drafted:
            by_source[source.source] = (drafted, accepted)
    return SpeculationDelta(
        num_draft_tokens=after.num_draft_tokens - before.num_draft_tokens,
        num_accepted_draft_tokens=after.num_accepted_draft_tokens - before.num_accepted_draft_tokens,
        num_verify_steps=after.num_verify_steps - before.num_verify_steps,
        num_plain_decode_steps=after.num_plain_decode_steps - before.num_plain_decode_steps,
        by_source=by_source,
    )


def read_steps_by_k(metrics_url: str, timeout_s: float) -> dict[int, int] | None:
    """The scheduler's steps by chosen k, which only the Prometheus page carries; None when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(metrics_url, timeout=timeout_s) as response:
            text = response.read().decode()
    except OSError:
        return None
    steps: dict[int, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == STEPS_BY_K_METRIC:
            for sample in family.samples:
                if sample.name == f"{STEPS_BY_K_METRIC}_total":
                    steps[int(sample.labels["k"])] = int(sample.value)
    return steps


def steps_delta(before: dict[int, int] | None, after: dict[int, int] | None) -> dict[int, int] | None:
    if before is None or after is None:
        return None
    delta = {k: count - before.get(k, 0) for k, count in after.items()}
    return {k: count for k, count in sorted(delta.items()) if count}
