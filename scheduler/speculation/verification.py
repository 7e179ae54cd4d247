"""A verify step's result: checked against what was proposed, then booked.

The worker names the draft nodes it accepted (a chain's first ones, or a branch of a
token tree); the scheduler checks that they are a branch of the proposal holding the
accepted tokens, followed by exactly one more token, and never walks the tree itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from common.draft_rules import branch_problem
from common.trees import leading_nodes, parents_or_chain, tree_depths
from proto import messages as m
from scheduler.batching import StepSeq
from scheduler.requests import Request
from scheduler.speculation.acceptance import GRAMMAR
from scheduler.speculation.counters import SpecCounters
from scheduler.speculation.state import SpecState


def step_result_problem(seqs: Sequence[StepSeq], outputs: Mapping[str, m.SeqOutput]) -> str:
    """Why a step result cannot be right ("" when it can): every sampling sequence gets its tokens, the accepted
    drafts are a branch of what was proposed, then exactly one more token."""
    for seq in seqs:
        if not seq.samples:
            continue
        rid = seq.request.request_id
        output = outputs.get(rid)
        if output is None or not output.token_ids:
            return f"no token for {rid}"
        accepted = output.num_accepted_draft
        if not 0 <= accepted <= len(seq.draft_token_ids) or len(output.token_ids) != accepted + 1:
            return (
                f"{rid}: {len(output.token_ids)} tokens with {accepted} accepted of {len(seq.draft_token_ids)} drafts"
            )
        parents = parents_or_chain(seq.draft_parents, len(seq.draft_token_ids))
        if problem := branch_problem(parents, seq.draft_token_ids, output.accepted_nodes, output.token_ids[:accepted]):
            return f"{rid}: {problem}"
    return ""


def logprobs_problem(
    seqs: Sequence[StepSeq], outputs: Mapping[str, m.SeqOutput], scored: Mapping[str, m.PromptLogprobs]
) -> str:
    """Why a step result's log-probabilities cannot be what the step asked ("" when they can): one per new token where
    the request asked, none where it did not, and a prompt chunk's where its SeqWork asked."""
    for seq in seqs:
        request = seq.request
        output = outputs.get(request.request_id) if seq.samples else None
        if output is not None and (output.logprobs is not None) != (request.num_logprobs >= 0):
            return (
                f"{request.request_id}: log-probabilities {'missing' if output.logprobs is None else 'not asked for'}"
            )
        if (
            output is not None
            and output.logprobs is not None
            and (
                len(output.logprobs) != len(output.token_ids)
                or any(len(entry.top) > request.num_logprobs for entry in output.logprobs)
            )
        ):
            return f"{request.request_id}: {len(output.logprobs)} log-probabilities for {len(output.token_ids)} tokens"
        entry = scored.get(request.request_id)
        if (entry is None) != (seq.prompt_scores is None):
            return f"{request.request_id}: prompt log-probabilities {'missing' if entry is None else 'not asked for'}"
        if entry is not None and len(entry.entries) != seq.prompt_scores:
            return f"{request.request_id}: {len(entry.entries)} prompt log-probabilities, {seq.prompt_scores} asked for"
    if unknown := set(scored) - {seq.request.request_id for seq in seqs}:
        return f"prompt log-probabilities for {sorted(unknown)}, not in the step"
    return ""


def record_verification(
    request: Request, seq: StepSeq, output: m.SeqOutput, counters: SpecCounters, state: SpecState
) -> None:
    """A checked step result's speculation: the request's and the server's counts, and what the draft holds now."""
    num_drafts, num_accepted = len(seq.draft_token_ids), output.num_accepted_draft
    if num_drafts:
        request.num_draft_tokens += num_drafts
        request.num_accepted_draft_tokens += num_accepted
        request.num_verify_steps += 1
        if state.draft.generation == seq.draft_generation:  # else the draft's state was reset meanwhile
            # The draft service holds a tree's tokens in node order: what it holds in place is the branch's
            # part that is the first nodes.
            state.draft.accept(leading_nodes(output.accepted_nodes))
    if num_drafts or seq.num_tokens == 1:  # a decode step, with or without a proposal
        depth = max(tree_depths(seq.draft_parents), default=0) if seq.draft_parents is not None else num_drafts
        counters.record(
            num_drafts,
            num_accepted,
            depth,
            seq.draft_source,
            output.accepted_nodes if seq.draft_parents is not None else None,
        )
        if not num_drafts:
            state.acceptance.plain_step()
        elif seq.draft_source != GRAMMAR:
            state.acceptance.observe(seq.draft_source, depth, num_accepted)
        if num_drafts and seq.draft_chances is not None:
            predicted = sum(seq.draft_chances)
            counters.acceptance.observe_chances(seq.draft_source, predicted, num_accepted)
            state.acceptance.observe_chances(seq.draft_source, predicted, num_accepted)
