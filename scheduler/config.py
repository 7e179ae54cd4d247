"""The scheduler's frozen configuration, parsed and validated once at the command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from common.arguments import below_problem, not_positive_problem
from common.draft_spec import DraftKind, DraftSpec
from common.defaults import (HEAD_DRAFT_TOKENS, MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS,
                             MODEL_SPEC_BATCH_THRESHOLD, NUM_SPECULATIVE_TOKENS, SPEC_BATCH_THRESHOLD)
from common.transport import Transport
from common.transport import add_arguments as add_transport_arguments
from common.transport import from_arguments as transport_from_arguments
from proto.messages import GATEWAY_HEARTBEAT_INTERVAL_S, MAX_NAME_CHARS

SPECULATION_POLICIES = ("goodput", "fixed")
SCHEDULING_POLICIES = ("fcfs", "priority")


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
    # k: draft tokens proposed per sequence and step (0 turns speculation off); None: the draft's kind's (speculation_caps)
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
    parser.add_argument("--gateway-address", default="tcp://127.0.0.1:5555")
    parser.add_argument("--worker-address", default="tcp://127.0.0.1:5556")
    parser.add_argument("--model-name", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    parser.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS)
    parser.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS, help="sequences in one step, and running on one worker")
    parser.add_argument("--max-queue-len", type=int, default=1024)
    parser.add_argument("--no-worker-timeout-s", type=float, default=30.0)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=5.0,
                        help="a worker or draft service silent this long is DEAD; a gateway silent this long is gone "
                             f"(gateways say a heartbeat every {GATEWAY_HEARTBEAT_INTERVAL_S:g} s)")
    parser.add_argument("--step-timeout-s", type=float, default=60.0)
    parser.add_argument("--status-file", type=Path, default=None, help="write LISTENING here once the sockets are bound (for container health checks)")
    parser.add_argument("--num-speculative-tokens", type=int, default=None,
                        help="draft tokens proposed per sequence in a speculative step (0: never speculate; default: "
                             f"{HEAD_DRAFT_TOKENS} for a draft head alone, else {NUM_SPECULATIVE_TOKENS}, as the draft "
                             "service's hello names its kind)")
    parser.add_argument("--spec-disable-batch-threshold", type=int, default=None,
                        help="speculate only when a step has at most this many sequences; larger ones decode plainly "
                             f"(default: {MODEL_SPEC_BATCH_THRESHOLD} for a draft that runs a model, else "
                             f"{SPEC_BATCH_THRESHOLD})")
    parser.add_argument("--spec-draft-token-budget", type=int, default=32,
                        help="draft tokens one speculative step verifies in all, shared evenly among its sequences "
                             "(k shrinks as steps grow; fewer than one each: a plain step)")
    parser.add_argument("--speculation-policy", choices=SPECULATION_POLICIES, default="goodput",
                        help="goodput: each step speculates only as far as what it measured says pays (the target's "
                             "step time, the wait for proposals, each request's acceptance), often not at all; fixed: "
                             "k up to the caps above in every step the threshold allows (for comparison and tests)")
    parser.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                        help="fcfs: requests run in the order they came; priority: by each request's priority (lower "
                             "first, as in vLLM), then that order, and a worker out of KV pages preempts the lowest "
                             "priority first. Under fcfs a request with a priority other than 0 is refused")
    parser.add_argument("--phase-timeout-s", type=float, default=600.0,
                        help="a worker or draft start-up phase running longer is FAILED and the process told to stop")
    parser.add_argument("--propose-timeout-s", type=float, default=2.0,
                        help="how long a step waits for the draft service before it runs without proposals")
    parser.add_argument("--gone-listed-s", type=float, default=300.0,
                        help="how long a DEAD or FAILED process stays listed in GetServerInfo and /metrics")
    parser.add_argument("--gateway-gone-grace-s", type=float, default=10.0,
                        help="a gateway whose connection closed, or that was silent for --heartbeat-timeout-s, has this "
                             "long to come back (a network blip, a restart with the same --gateway-id); then its "
                             "requests, waiting and running, are aborted and their KV pages freed")
    parser.add_argument("--max-request-retries", type=int, default=2,
                        help="a request whose step was in flight on a worker that was lost is run again this many times "
                             "at most; the next loss fails it (a request that kills every worker it meets)")
    parser.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV pages of a cached prompt prefix (--no-prefix-cache: every prompt is computed)")
    add_transport_arguments(parser)


def from_arguments(args: argparse.Namespace) -> SchedulerConfig:
    positive = ("max_model_len", "max_num_batched_tokens", "max_num_seqs", "max_queue_len",
                "no_worker_timeout_s", "heartbeat_timeout_s", "step_timeout_s", "propose_timeout_s", "phase_timeout_s",
                "gone_listed_s")
    given = [name for name in ("num_speculative_tokens", "spec_disable_batch_threshold") if getattr(args, name) is not None]
    if problem := not_positive_problem(args, positive) or below_problem(
            args, (*given, "spec_draft_token_budget", "max_request_retries", "gateway_gone_grace_s"), 0):
        raise ValueError(problem)
    if len(args.model_name) > MAX_NAME_CHARS:  # it goes to every gateway (proto/frames.py)
        raise ValueError(f"--model-name: at most {MAX_NAME_CHARS} characters, got {len(args.model_name)}")
    transport_from_arguments(args, "scheduler", (("--gateway-address", args.gateway_address),
                                                ("--worker-address", args.worker_address)))
    return SchedulerConfig(**{field.name: getattr(args, field.name) for field in fields(SchedulerConfig)})  # one flag each


def speculation_caps(config: SchedulerConfig, draft_kind: str) -> tuple[int, int]:
    """(k at most, the most sequences a step speculates for): the flags given, else the defaults of the draft's kind
    (its hello's draft_kind; "" or one not known: a lookup's)."""
    try:
        spec = DraftSpec(DraftKind(draft_kind))
    except ValueError:
        spec = DraftSpec(DraftKind.NGRAM)
    k = spec.num_speculative_tokens if config.num_speculative_tokens is None else config.num_speculative_tokens
    threshold = (spec.spec_batch_threshold if config.spec_disable_batch_threshold is None
                 else config.spec_disable_batch_threshold)
    return k, threshold
