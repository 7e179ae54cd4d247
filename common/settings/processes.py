"""The settings of the processes that load a model (the target workers and the draft service), and the transport
settings every service shares; with the scheduler's (common/settings/table.py) and the gateway's and `up`'s
(common/settings/edge.py), the whole table."""

from __future__ import annotations

from pathlib import Path

from common.defaults import DRAFT_MAX_TOKENS, HEAD_DRAFT_TOKENS, KV_PAGE_SIZE, SUFFIX_CACHE_TOKENS
from common.quantization import QUANTIZATION_HELP, QUANTIZATIONS
from common.settings.choices import AUTO, CUDA_GRAPHS, DTYPES, SUFFIX_SCOPES
from common.settings.setting import Setting

_KEYS_ENV = "SPECSERVE_KEYS"  # common/transport.py's ENV_VAR (that module loads zmq; this table does not)

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
        "--cuda-graphs",
        ("worker", "up"),
        "decode and verify steps replayed from CUDA graphs captured while warming up: on (a failed capture fails "
        "the worker), fallback (a failed capture is reported and the worker serves eagerly), off; "
        f"{AUTO} (default): on with a CUDA device, else off",
        default=AUTO,
        choices=(AUTO, *CUDA_GRAPHS),
    ),
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
        "--suffix-cache-tokens",
        ("draft", "up"),
        "suffix and the phrases (--draft default): tokens of served text (prompts as they come, completions as they "
        "finish) kept to draft from, the oldest requests' dropped first; about 70-85 bytes a token with its index "
        "(docs/benchmarks.md); 0: none kept",
        int,
        SUFFIX_CACHE_TOKENS,
    ),
    Setting(
        "--suffix-scope",
        ("draft", "up"),
        "whose served text drafts for a request: tenant (its API key's, else its `user`'s, else the one tenant of "
        "callers nothing tells apart), global (everyone's: how fast a request runs then tells whether another caller "
        "wrote its text), request (its own only: the store is not kept); docs/security.md",
        choices=SUFFIX_SCOPES,
        default="tenant",
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
