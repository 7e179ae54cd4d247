"""The scheduler's frozen configuration, parsed and validated once at the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from common import settings
from common.arguments import below_problem, not_positive_problem
from common.draft_spec import MODEL_KINDS, DraftKind, DraftSpec
from common.transport import Transport
from common.transport import from_arguments as transport_from_arguments
from proto.messages import MAX_NAME_CHARS


@dataclass(frozen=True)
class SchedulerConfig:
    gateway_address: str  # bound ROUTER for gateways
    worker_address: str  # bound ROUTER for workers (and the draft service)
    model_name: str
    max_model_len: int  # prompt plus completion tokens at most
    max_num_batched_tokens: int  # new tokens in one step
    max_num_seqs: int  # sequences in one step, and running on one worker
    max_queue_len: int  # waiting requests at most; more are refused with RESOURCE_EXHAUSTED
    no_worker_timeout_s: float  # a request waiting this long with no READY worker fails UNAVAILABLE
    heartbeat_timeout_s: float  # a worker silent this long is DEAD; a gateway, gone
    step_timeout_s: float  # a step unanswered this long marks its worker DEAD
    status_file: Path | None = None  # LISTENING once its sockets are bound, for container health checks
    # k: draft tokens proposed per sequence and step (0 turns speculation off);
    # None: the draft's kind's (speculation_caps)
    num_speculative_tokens: int | None = None
    # speculate only in steps of at most this many sequences; None: the draft's kind's (speculation_caps)
    spec_disable_batch_threshold: int | None = None
    spec_draft_token_budget: int = 32  # draft tokens one step verifies in all (k per sequence shrinks as steps grow)
    # goodput: each step speculates as far as the measured step cost and acceptance say pays (policy.py); fixed: up
    # to the caps in every step the threshold allows.
    speculation_policy: str = "goodput"
    # fcfs: requests are placed in the order they came, and a worker out of pages preempts the one placed last;
    # priority: by their priority (lower first), then that order, and it preempts the lowest priority placed last.
    scheduling_policy: str = "fcfs"
    propose_timeout_s: float = 2.0  # a proposal unanswered this long: the step runs without one
    phase_timeout_s: float = 600.0  # a start-up phase (STARTING .. WARMING) longer than this FAILs the process
    prefix_cache: bool = True  # share the KV pages of equal prompt prefixes between requests
    max_request_retries: int = 2  # a request in the step of this many lost workers is retried; one more fails it
    gone_listed_s: float = 300.0  # a DEAD or FAILED process is listed (GetServerInfo, /metrics) this long, then not
    # A gateway gone (its connection closed, or silent for heartbeat_timeout_s) this long has its requests aborted.
    gateway_gone_grace_s: float = 10.0
    keys: Path | None = None  # the CurveZMQ key folder (common/transport.py); None: --insecure-loopback
    insecure_loopback: bool = False  # no keys, every address on loopback

    @property
    def transport(self) -> Transport:
        return Transport(self.keys)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    settings.add_arguments(parser, "scheduler")


def from_arguments(args: argparse.Namespace) -> SchedulerConfig:
    positive = (
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_queue_len",
        "no_worker_timeout_s",
        "heartbeat_timeout_s",
        "step_timeout_s",
        "propose_timeout_s",
        "phase_timeout_s",
        "gone_listed_s",
    )
    given = [
        name for name in ("num_speculative_tokens", "spec_disable_batch_threshold") if getattr(args, name) is not None
    ]
    if problem := not_positive_problem(args, positive) or below_problem(
        args, (*given, "spec_draft_token_budget", "max_request_retries", "gateway_gone_grace_s"), 0
    ):
        raise ValueError(problem)
    if len(args.model_name) > MAX_NAME_CHARS:  # it goes to every gateway (proto/frames.py)
        raise ValueError(f"--model-name: at most {MAX_NAME_CHARS} characters, got {len(args.model_name)}")
    transport_from_arguments(
        args, "scheduler", (("--gateway-address", args.gateway_address), ("--worker-address", args.worker_address))
    )
    return SchedulerConfig(
        **{field.name: getattr(args, field.name) for field in fields(SchedulerConfig)}
    )  # one flag each


def runs_a_model(draft_kind: str) -> bool:
    """Whether a draft of this kind (its hello's draft_kind) runs a model per proposal, so that a longer proposal costs
    it more; a lookup's ("" or one not known too) costs it next to nothing more."""
    try:
        return DraftKind(draft_kind) in MODEL_KINDS
    except ValueError:
        return False


def speculation_caps(config: SchedulerConfig, draft_kind: str) -> tuple[int, int]:
    """(k at most, the most sequences a step speculates for): the flags given, else the defaults of the draft's kind
    (its hello's draft_kind; "" or one not known: a lookup's)."""
    try:
        spec = DraftSpec(DraftKind(draft_kind))
    except ValueError:
        spec = DraftSpec(DraftKind.NGRAM)
    k = spec.num_speculative_tokens if config.num_speculative_tokens is None else config.num_speculative_tokens
    threshold = (
        spec.spec_batch_threshold
        if config.spec_disable_batch_threshold is None
        else config.spec_disable_batch_threshold
    )
    return k, threshold
