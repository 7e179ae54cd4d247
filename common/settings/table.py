"""The settings of the scheduler and the limits several services share; with the model processes'
(common/settings/processes.py) and the gateway's and `up`'s (common/settings/edge.py), the whole table.
Defaults shared with other code live in common/defaults.py."""

from __future__ import annotations

from pathlib import Path

from common.defaults import (
    HEAD_DRAFT_TOKENS,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    MODEL_SPEC_BATCH_THRESHOLD,
    NUM_SPECULATIVE_TOKENS,
    SPEC_BATCH_THRESHOLD,
)
from common.settings.choices import SCHEDULING_POLICIES, SPECULATION_POLICIES
from common.settings.edge import EDGE
from common.settings.processes import DRAFT, MODEL_PROCESSES, TRANSPORT, WORKER
from common.settings.setting import Setting
from proto.messages import GATEWAY_HEARTBEAT_INTERVAL_S

LIMITS = (
    Setting(
        "--max-model-len",
        ("scheduler", "worker", "draft"),
        "tokens per sequence at most (prompt and completion)",
        int,
        MAX_MODEL_LEN,
        env="SPECSERVE_MAX_MODEL_LEN",
    ),
    Setting(
        "--max-num-seqs",
        ("scheduler", "worker", "up"),
        "sequences in one step, and running on one worker, at most",
        int,
        MAX_NUM_SEQS,
    ),
    Setting(
        "--max-num-batched-tokens",
        ("scheduler", "worker", "up"),
        "new tokens in one step at most (a longer prompt runs in chunks)",
        int,
        MAX_NUM_BATCHED_TOKENS,
    ),
)

SCHEDULER = (
    Setting(
        "--gateway-address",
        ("scheduler",),
        "the socket gateways connect to",
        default="tcp://127.0.0.1:5555",
        deployment=True,
    ),
    Setting(
        "--worker-address",
        ("scheduler",),
        "the socket target workers and the draft service connect to",
        default="tcp://127.0.0.1:5556",
        deployment=True,
    ),
    Setting(
        "--model-name",
        ("scheduler",),
        "the name clients send in `model`",
        default="SmolLM2-135M-Instruct",
        env="SPECSERVE_MODEL_NAME",
    ),
    Setting(
        "--max-queue-len",
        ("scheduler",),
        "waiting requests at most; more are refused with RESOURCE_EXHAUSTED",
        int,
        1024,
    ),
    Setting(
        "--no-worker-timeout-s",
        ("scheduler",),
        "a request waiting this long with no READY worker fails UNAVAILABLE",
        float,
        30.0,
    ),
    Setting(
        "--heartbeat-timeout-s",
        ("scheduler",),
        "a worker or draft service silent this long is DEAD; a gateway silent this long is gone "
        f"(gateways say a heartbeat every {GATEWAY_HEARTBEAT_INTERVAL_S:g} s)",
        float,
        5.0,
    ),
    Setting("--step-timeout-s", ("scheduler",), "a step unanswered this long marks its worker DEAD", float, 60.0),
    Setting(
        "--status-file",
        ("scheduler",),
        "write LISTENING here once the sockets are bound (for container health checks)",
        Path,
        deployment=True,
    ),
    Setting(
        "--num-speculative-tokens",
        ("scheduler", "up"),
        "draft tokens proposed per sequence in a speculative step (0: never speculate; default: "
        f"{HEAD_DRAFT_TOKENS} for a draft head alone, else {NUM_SPECULATIVE_TOKENS}, as the draft service's hello "
        "names its kind)",
        int,
    ),
    Setting(
        "--spec-disable-batch-threshold",
        ("scheduler", "up"),
        "speculate only when a step has at most this many sequences; larger ones decode plainly (default: "
        f"{MODEL_SPEC_BATCH_THRESHOLD} for a draft that runs a model, else {SPEC_BATCH_THRESHOLD})",
        int,
    ),
    Setting(
        "--spec-draft-token-budget",
        ("scheduler", "up"),
        "draft tokens one speculative step verifies in all, shared evenly among its sequences (k shrinks as steps "
        "grow; fewer than one each: a plain step)",
        int,
        32,
    ),
    Setting(
        "--speculation-policy",
        ("scheduler", "up"),
        "goodput: each step speculates only as far as what it measured says pays (the target's step time, the "
        "wait for proposals, each request's acceptance), often not at all; fixed: k up to the caps above in every "
        "step the threshold allows (for comparison and tests)",
        choices=SPECULATION_POLICIES,
        default="goodput",
    ),
    Setting(
        "--scheduling-policy",
        ("scheduler", "up"),
        "fcfs: requests run in the order they came; priority: by each request's priority (lower first, as in "
        "vLLM), then that order, and a worker out of KV pages preempts the lowest priority first. Under fcfs a "
        "request with a priority other than 0 is refused",
        choices=SCHEDULING_POLICIES,
        default="fcfs",
    ),
    Setting(
        "--phase-timeout-s",
        ("scheduler",),
        "a worker or draft start-up phase running longer is FAILED and the process told to stop",
        float,
        600.0,
    ),
    Setting(
        "--propose-timeout-s",
        ("scheduler",),
        "how long a step waits for the draft service before it runs without proposals",
        float,
        2.0,
    ),
    Setting(
        "--gone-listed-s",
        ("scheduler",),
        "how long a DEAD or FAILED process stays listed in GetServerInfo and /metrics",
        float,
        300.0,
    ),
    Setting(
        "--gateway-gone-grace-s",
        ("scheduler",),
        "a gateway whose connection closed, or that was silent for --heartbeat-timeout-s, has this long to come "
        "back (a network blip, a restart with the same --gateway-id); then its requests, waiting and running, are "
        "aborted and their KV pages freed",
        float,
        10.0,
    ),
    Setting(
        "--max-request-retries",
        ("scheduler",),
        "a request whose step was in flight on a worker that was lost is run again this many times at most; the "
        "next loss fails it (a request that kills every worker it meets)",
        int,
        2,
    ),
    Setting(
        "--prefix-cache",
        ("scheduler", "up"),
        "reuse the KV pages of a cached prompt prefix (--no-prefix-cache: every prompt is computed)",
        default=True,
        action="toggle",
    ),
)

SETTINGS = (*LIMITS, *SCHEDULER, *MODEL_PROCESSES, *WORKER, *DRAFT, *TRANSPORT, *EDGE)
