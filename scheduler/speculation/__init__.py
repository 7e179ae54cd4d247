"""Speculation, all of it as the scheduler sees it: one speculative step reads top to bottom here.

1. policy.py decides whether a planned step speculates and how many draft tokens (k) each
   decoding sequence may get; goodput.py puts its rule to one target's step.
2. link.py (DraftLink, the one object the rest of the scheduler asks) narrows that to the
   sequences the current draft service can serve, and keeps the requests the draft
   service must forget; proposing.py builds the ProposeRequest and keeps the propose
   requests in flight and the ones given up on. A request whose grammar forces its next
   tokens is not asked for any: those are its drafts (forced.py).
3. When the answer comes, each proposal is checked against the rules shared with the
   worker (common/draft_rules.py) and what the draft service holds for the request is
   updated (views.py); the step goes to the target with the proposals that passed, each
   cut to the length that pays (goodput.py).
4. When the step result comes, verification.py checks it (the accepted nodes are a
   branch of the proposal, then one more token) and books it: the request's and the
   server's counters (counters.py) and the draft view.
5. features.py keeps the target features a draft head reads, between steps.
"""
