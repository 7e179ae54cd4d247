"""The settings of the scheduler, the target workers and the draft service; with the gateway's and `up`'s
(common/settings/edge.py), the whole table. Defaults shared with other code live in common/defaults.py."""

from __future__ import annotations

from pathlib import Path

from common.defaults import (
    DRAFT_MAX_TOKENS,
    HEAD_DRAFT_TOKENS,
    KV_PAGE_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    MODEL_SPEC_BATCH_THRESHOLD,
    NUM_SPECULATIVE_TOKENS,
    SPEC_BATCH_THRESHOLD,
)
from common.quantization import QUANTIZATION_HELP, QUANTIZATIONS
from common.settings.choices import AUTO, DTYPES, SCHEDULING_POLICIES, SPECULATION_POLICIES
from common.settings.edge import EDGE
from common.settings.setting import Setting
from proto.messages import GATEWAY_HEARTBEAT_INTERVAL_S

_KEYS_ENV = "SPECSERVE_KEYS"  # common/transport.py's ENV_VAR (that module loads zmq; this table does not)

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

MODEL_PROCESSES = (  # the target workers and the draft service: lifecycle processes that load a model
    Setting(
        "--worker-id",
        ("worker",),
        "its id at the scheduler; with {slot} in it, see --slot-dir",
        default="worker-0",
        deployment=True,
    ),
    Setting(
        "--worker-id",
        ("draft",),
        "its id at the scheduler; with {slot} in it, see --slot-dir",
        default="draft-0",
        deployment=True,
    ),
    Setting(
        "--slot-dir",
        ("worker", "draft"),
        "a folder shared by copies of this process: each takes the lowest free slot number for {slot} in "
        "--worker-id (and --device cuda:{slot}: its own GPU only)",
        Path,
        deployment=True,
    ),
    Setting(
        "--scheduler-address",
        ("worker", "draft"),
        "the scheduler's socket for workers",
        default="tcp://127.0.0.1:5556",
        deployment=True,
    ),
    Setting("--device", ("worker", "draft"), "cpu or cuda:N", default="cpu"),
    Setting(
        "--dtype",
        ("worker", "draft", "up"),
        f"the weights' and activations' dtype; {AUTO} (default): bfloat16 where the hardware computes it natively "
        "(GPUs, CPUs with AVX512-BF16 or AMX), else float32",
        choices=(AUTO, *DTYPES),
        default=AUTO,
    ),
    Setting("--heartbeat-interval-s", ("worker", "draft"), "how often it tells the scheduler it is alive", float, 0.5),
    Setting(
        "--phase-timeout-s",
        ("worker", "draft"),
        "a start-up phase (loading, allocating, warming) running longer fails the process",
        float,
        600.0,
    ),
    Setting("--step-timeout-s", ("worker", "draft"), "a step running longer fails the process", float, 120.0),
    Setting(
        "--drain-timeout-s",
        ("worker", "draft"),
        "after SIGTERM, how long requests in flight may take before the process stops anyway",
        float,
        30.0,
    ),
    Setting(
        "--num-threads",
        ("worker",),
        "threads to compute on (CPU); 0: the cores this process may use (its "
        "affinity mask, capped by a cgroup CPU quota)",
        int,
        0,
        env="SPECSERVE_WORKER_THREADS",
    ),
    Setting(
        "--num-threads",
        ("draft",),
        "threads to compute on (CPU); 0: the cores this process may use. One by "
        "default: the draft shares the machine with the target workers",
        int,
        1,
    ),
    Setting(
        "--status-file",
        ("worker", "draft"),
        "write the lifecycle state here at every transition",
        Path,
        deployment=True,
    ),
)

WORKER = (
    Setting(
        "--model",
        ("worker", "gateway"),
        "the model folder (a Hugging Face folder, or one converted from GGUF)",
        Path,
        required=True,
        env="SPECSERVE_MODEL",
        deployment=True,
    ),
    Setting(
        "--kv-cache-memory",
        ("worker", "up"),
        "GiB of memory for each target worker's KV cache (keys and values of every page). Default: a quarter of "
        "the memory available when the worker starts on CPU, half the free device memory on CUDA, and never more "
        "than --max-num-seqs sequences of --max-model-len tokens need",
        float,
    ),
    Setting("--page-size", ("worker",), "positions per KV page", int, KV_PAGE_SIZE),
    Setting("--max-draft-tokens", ("worker",), "the longest proposal a verify step carries", int, DRAFT_MAX_TOKENS),
    Setting(
        "--require-batch-invariance",
        ("worker", "up"),
        "serve without speculation where a worker's steps are not batch invariant (torch's ops, a GPU), so that "
        "greedy answers equal plain decoding's bit for bit; without it such a worker verifies drafts losslessly "
        "in distribution, as GPU engines do",
        action="switch",
    ),
    Setting(
        "--quantization",
        ("worker", "up"),
        f"{QUANTIZATION_HELP}; {AUTO} (default): the model's own GGUF blocks on a CPU where its projections are "
        "all in a format the kernel reads (not the embedded default in bfloat16 on a CPU with AMX, where dense "
        "weights are faster from 16 concurrent requests: docs/benchmarks.md), else none",
        choices=(AUTO, *QUANTIZATIONS),
        default=AUTO,
    ),
)

DRAFT = (
    Setting(
        "--proposer",
        ("draft",),
        "what proposes: 'default' (prompt lookup, then the phrases shipped for the embedded default model when "
        "--target-model is that model, else prompt lookup alone), 'ngram' (prompt lookup), 'model:PATH' (a draft "
        "model folder whose vocabulary matches the target's), 'phrases:PATH' (prompt lookup, then the target's own "
        "phrases kept in PATH by `specserve "
        "distill` for the target named by --target-model), 'eagle:PATH' (a draft head made by `specserve distill` "
        "for that target), 'eagle+ngram:PATH' (prompt lookup, that head elsewhere), 'eagle+phrases:PATH' (prompt "
        "lookup, then the folder's phrases, its head elsewhere), or, for tests only, 'random:VOCAB_SIZE' (random "
        "tokens) and 'replay:FILE' (continuations from a JSON list of token-id sequences)",
        default="default",
        env="SPECSERVE_DRAFT",
    ),
    Setting(
        "--target-model",
        ("draft",),
        "the target's model folder (needed by phrases:PATH and the eagle kinds)",
        Path,
        env="SPECSERVE_MODEL",
        deployment=True,
    ),
    Setting(
        "--max-draft-tokens",
        ("draft",),
        "the longest proposal it makes (the scheduler asks for k up to its own cap)",
        int,
        DRAFT_MAX_TOKENS,
    ),
    Setting(
        "--head-draft-tokens",
        ("draft",),
        "eagle+ngram, eagle+phrases: the longest proposal the head makes; a lookup's may be --max-draft-tokens long",
        int,
        HEAD_DRAFT_TOKENS,
    ),
    Setting(
        "--token-trees",
        ("draft", "up"),
        "phrases: guess a token tree (the likeliest branches of the phrases and prompt lookup, verified in one "
        "step); --no-token-trees: one chain",
        default=True,
        action="toggle",
    ),
    Setting("--ngram-min", ("draft",), "prompt lookup tries n-grams from --ngram-max down to this", int, 2),
    Setting("--ngram-max", ("draft",), "the longest n-gram prompt lookup matches", int, 4),
    Setting(
        "--num-seqs",
        ("draft",),
        "sequences a draft model holds at once, for each target worker (see --num-targets)",
        int,
        64,
    ),
    Setting(
        "--num-targets",
        ("draft",),
        "the target workers it drafts for: it holds --num-seqs times this many sequences",
        int,
        1,
        env="SPECSERVE_WORKERS",
    ),
    Setting(
        "--draft-top-k", ("draft",), "a sampled draft token is drawn from the draft's k most likely at most", int, 32
    ),
    Setting(
        "--quantization",
        ("draft",),
        f"for a draft model (--proposer model:PATH): {QUANTIZATION_HELP}",
        choices=QUANTIZATIONS,
        default="none",
    ),
)

TRANSPORT = (
    Setting(
        "--keys",
        ("scheduler", "worker", "draft", "gateway"),
        f"the CurveZMQ key folder made by `specserve keys FOLDER` (default: ${_KEYS_ENV}); every socket between "
        "the services is authenticated and encrypted with it",
        Path,
        default_env=_KEYS_ENV,
        deployment=True,
    ),
    Setting(
        "--insecure-loopback",
        ("scheduler", "worker", "draft", "gateway"),
        "run without keys: any local process can then speak for a gateway or a worker, so every address must be "
        "on 127.0.0.1 (or ::1, ipc://)",
        action="switch",
        deployment=True,
    ),
    Setting(
        "--log-json",
        ("scheduler", "worker", "draft", "gateway", "up"),
        "log JSON lines instead of console text",
        action="switch",
        deployment=True,
    ),
)

SETTINGS = (*LIMITS, *SCHEDULER, *MODEL_PROCESSES, *WORKER, *DRAFT, *TRANSPORT, *EDGE)
