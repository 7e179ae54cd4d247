"""Defaults more than one service shares, written once: every service's flag and `specserve up` take them from here
(docker-compose.yml repeats them as its variables' defaults, and tests/unit/test_compose.py holds it to these)."""

MAX_MODEL_LEN = 2048  # tokens per sequence at most (`up`: fewer where the model has fewer positions)
MAX_NUM_SEQS = 256  # sequences in one step, and running on one worker, at most
MAX_NUM_BATCHED_TOKENS = 512  # tokens in one step at most (prompts longer run in chunks)

# Speculation's caps unless told, by the draft's kind (the scheduler learns it from the draft service's hello):
NUM_SPECULATIVE_TOKENS = 6  # k, draft tokens a sequence's step verifies at most: a lookup's long ones pay often...
HEAD_DRAFT_TOKENS = 3  # ...a draft head's beyond this many are accepted too rarely to pay (docs/benchmarks.md)
SPEC_BATCH_THRESHOLD = 16  # steps of more sequences never speculate: lookups cost the draft nothing and pay to 16...
MODEL_SPEC_BATCH_THRESHOLD = 4  # ...a draft that runs a model (a head, a draft model) pays to about 4
SUFFIX_CACHE_TOKENS = 1_000_000  # served tokens the draft service keeps to draft from (about 80 MB)
DRAFT_MAX_TOKENS = 8  # the draft service's longest proposal unless told: past every k above
KV_PAGE_SIZE = 16  # positions per KV page
HTTP_MAX_BODY_BYTES = 32 * 2**20  # a long-context prompt as text is a few MiB at most
HTTP_READ_TIMEOUT_S = 30.0  # an HTTP body not all received by then gets 408
