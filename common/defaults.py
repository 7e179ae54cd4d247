"""Defaults more than one service shares, written once: every service's flag and `specserve up` take them from here
(docker-compose.yml repeats them as its variables' defaults, and tests/unit/test_compose.py holds it to these)."""

MAX_MODEL_LEN = 2048  # tokens per sequence at most (`up`: fewer where the model has fewer positions)
MAX_NUM_SEQS = 256  # sequences in one step, and running on one worker, at most
MAX_NUM_BATCHED_TOKENS = 512  # tokens in one step at most (prompts longer run in chunks)
