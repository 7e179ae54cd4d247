"""Defaults shared by the draft service and `specserve up`, in a module light enough for the command line to import."""

# The --proposer kinds by what they need: a draft head (which runs a model), a folder made by
# `specserve distill` for one target (so --target-model), a model run per proposal.
HEAD_KINDS = ("eagle", "eagle+ngram", "eagle+phrases")
DISTILLED_KINDS = ("phrases", *HEAD_KINDS)
MODEL_KINDS = ("model", *HEAD_KINDS)
LOOKUP_THEN_HEAD_KINDS = ("eagle+ngram", "eagle+phrases")  # the head proposes only where no lookup matches

# How many tokens a draft head proposes at a time, unless told: beyond this many its
# proposals are accepted too rarely to pay for themselves (docs/benchmarks.md, issue 6).
HEAD_DRAFT_TOKENS = 3

