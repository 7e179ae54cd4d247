"""The speculation decision and its bookkeeping, as plain functions and records.

The policy: a step speculates when it has at most `spec_disable_batch_threshold`
sequences; then every sequence that is decoding gets k draft tokens, fewer when its
max_tokens, the context or the step's token budget leave less room, and at most
`spec_draft_token_budget` draft tokens in all, shared evenly (so k shrinks as the batch
grows: 6 at up to 5 sequences with the default 32, 4 at 8, 2 at 16). Larger steps decode
plainly: there the target is busy enough that verifying rejected tokens costs more than
it saves; and on a CPU every verified token costs compute, so the more sequences, the
fewer guesses each may make (docs/benchmarks.md, issue 6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proto import messages as m
from modeling.rejection import sparse_dist_problem
from modeling.trees import follow, leading_nodes, parents_or_chain, tree_depths
from scheduler.batching import ScheduledSeq
from scheduler.registry import StepSeq
from scheduler.request import Request


@dataclass(frozen=True)
class SpecLimits:
    num_speculative_tokens: int  # k at most (the smallest of the scheduler's, the target's and the draft's)
    spec_disable_batch_threshold: int
    spec_draft_token_budget: int  # draft tokens one step verifies in all, shared evenly among its decoding sequences
    max_num_batched_tokens: int
    max_model_len: int


def speculation_plan(plan: list[ScheduledSeq], limits: SpecLimits) -> dict[str, int]:
    """k per request id for the decoding sequences of a planned step; empty: decode plainly."""
    if limits.num_speculative_tokens < 1 or len(plan) > limits.spec_disable_batch_threshold:
        return {}
    decodes = [item for item in plan if item.completes and item.num_tokens == 1]
    if not decodes:
        return {}
    spare = limits.max_num_batched_tokens - sum(item.num_tokens for item in plan)
    k_max = min(limits.num_speculative_tokens, spare // len(decodes), limits.spec_draft_token_budget // len(decodes))
    ks: dict[str, int] = {}
    for item in decodes:
        r = item.request
        # Every new token (the accepted drafts plus one) must fit in max_tokens and the context.
        k = min(k_max, r.max_tokens - len(r.output_token_ids) - 1, limits.max_model_len - r.num_tokens - 1)
        if k >= 1:
            ks[r.request_id] = k
    return ks


@dataclass
class PendingProposal:
    """A target worker's next step, waiting for the draft service's proposals."""

    propose_id: int
    worker_id: str
    worker_incarnation: int
    plan: list[ScheduledSeq]
    num_tokens: dict[str, int]  # k asked for, per request id
    sent_at_s: float


def proposal_problem(proposal: m.Proposal, num_tokens: int, vocab_size: int, sequence_len: int) -> str:
    """Why a proposal cannot be verified ("" when it can): a bad draft must never reach a target."""
    if not 0 <= proposal.num_held <= sequence_len:
        return f"num_held {proposal.num_held} for a sequence of {sequence_len} tokens"
    if len(proposal.token_ids) > num_tokens:
        return f"{len(proposal.token_ids)} tokens proposed, {num_tokens} asked for"
    if vocab_size and any(not 0 <= t < vocab_size for t in proposal.token_ids):
        return f"a proposed token is outside the vocabulary 0..{vocab_size - 1}"
    if proposal.parents is not None:
        if proposal.dists is not None:
            return "a token tree with distributions (a tree's tokens must be point masses)"
        if len(proposal.parents) != len(proposal.token_ids):
            return f"{len(proposal.parents)} parents for {len(proposal.token_ids)} tokens"
        try:
            tree_depths(proposal.parents)
        except ValueError as exc:
            return str(exc)
    if proposal.dists is None:
        return ""
    if len(proposal.dists) != len(proposal.token_ids):
        return f"{len(proposal.dists)} distributions for {len(proposal.token_ids)} tokens"
    for token, dist in zip(proposal.token_ids, proposal.dists):
        if problem := sparse_dist_problem(dist, vocab_size):
            return problem
        if token not in dist.token_ids:
            return "a distribution does not cover the token drawn from it"
    return ""


@dataclass
class SpecCounters:
    """Server-wide, per sequence and step: what was proposed and accepted."""

    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_verify_steps: int = 0
    num_plain_decode_steps: int = 0
    steps_by_k: dict[int, int] = field(default_factory=dict)  # per step sent to a target: the largest k chosen

    def decide(self, k: int) -> None:
        self.steps_by_k[k] = self.steps_by_k.get(k, 0) + 1

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        if num_draft_tokens:
            self.num_draft_tokens += num_draft_tokens
            self.num_accepted_draft_tokens += num_accepted
            self.num_verify_steps += 1
        else:
            self.num_plain_decode_steps += 1

    def info(self) -> m.SpeculationInfo:
        return m.SpeculationInfo(
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_draft_tokens=self.num_accepted_draft_tokens,
            num_verify_steps=self.num_verify_steps,
            num_plain_decode_steps=self.num_plain_decode_steps,
            acceptance_rate=self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            mean_accepted_length=self.num_accepted_draft_tokens / self.num_verify_steps if self.num_verify_steps else 0.0,
            steps_by_k=dict(self.steps_by_k),
        )


def step_result_problem(seqs: list[StepSeq], outputs: dict[str, m.SeqOutput]) -> str:
    """Why a step result cannot be right ("" when it can): every sampling sequence gets its tokens,
    the accepted drafts are a prefix of what was proposed, then exactly one more token."""
    for seq in seqs:
        if not seq.samples:
            continue
        output = outputs.get(seq.request.request_id)
        if output is None or not output.token_ids:
            return f"no token for {seq.request.request_id}"
        accepted = output.num_accepted_draft
        if not 0 <= accepted <= len(seq.draft_token_ids) or len(output.token_ids) != accepted + 1 \
                or accepted_branch(seq, output) is None:
            return f"{seq.request.request_id}: {len(output.token_ids)} tokens with {accepted} accepted of {len(seq.draft_token_ids)} drafts"
    return ""


def accepted_branch(seq: StepSeq, output: m.SeqOutput) -> list[int] | None:
    """The draft nodes the output accepted, in order (a chain's first ones); None if they are no branch of the proposal."""
    parents = parents_or_chain(seq.draft_parents, len(seq.draft_token_ids))
    return follow(parents, seq.draft_token_ids, output.token_ids[: output.num_accepted_draft])


def record_verification(request: Request, seq: StepSeq, output: m.SeqOutput, counters: SpecCounters) -> None:
    """A checked step result's speculation: the request's and the server's counts, and what the draft holds now."""
    num_drafts, num_accepted = len(seq.draft_token_ids), output.num_accepted_draft
    if num_drafts:
        request.num_draft_tokens += num_drafts
        request.num_accepted_draft_tokens += num_accepted
        request.num_verify_steps += 1
        if request.draft.generation == seq.draft_generation:  # else the draft's state was reset meanwhile
            # The draft service holds a tree's tokens in node order: what it holds in place is the branch's
            # part that is the first nodes.
            request.draft.accept(leading_nodes(accepted_branch(seq, output) or []))
    if num_drafts or seq.num_tokens == 1:  # a decode step, with or without a proposal
        counters.record(num_drafts, num_accepted)
