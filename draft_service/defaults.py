"""Defaults shared by the draft service and `specserve up`, in a module light enough for the command line to import.

The proposer kinds, and what each needs, are in common/draft_spec.py.
"""

# How many tokens a draft head proposes at a time, unless told: beyond this many its
# proposals are accepted too rarely to pay for themselves (docs/benchmarks.md).
HEAD_DRAFT_TOKENS = 3
