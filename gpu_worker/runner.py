"""Runs steps on one model replica: checks them against the KV slots, forwards, samples."""

from __future__ import annotations

import torch

from gpu_worker.config import WorkerConfig
from modeling.batch import SeqSpan
from modeling.config import ModelConfig
from modeling.engine import ModelEngine
from modeling.features import to_rows
from modeling.kv_cache import SlotError, SlotTable
from modeling.proposals import drafts_problem
from modeling.rejection import verify, verify_tree_greedy, verify_tree_sampled
from modeling.trees import leading_nodes, parents_or_chain
from proto.messages import SeqFeatures, SeqOutput, SeqWork


class ModelRunner:
    """The target model and the slot table, built in phases by the worker."""

    def __init__(self, config: WorkerConfig, model_config: ModelConfig) -> None:
        self._config = config
        self._model_config = model_config
        self._engine = ModelEngine(config.model, model_config, device=config.process.device, dtype=config.process.dtype,
                                   num_slots=config.num_kv_slots, max_len=config.max_model_len)
        self._slots = SlotTable(config.num_kv_slots, config.max_model_len)

    @property
    def num_used_slots(self) -> int:
        return self._slots.num_used

    # ------------------------------------------------------------------ phases

    def load(self) -> None:
        self._engine.load()

    @property
    def ops(self) -> str:
        """Which ops the loaded model runs on, and why."""
        return self._engine.ops

    def allocate(self) -> None:
        self._engine.allocate()

    def warm_up(self) -> str | None:
        """Forward passes at the largest shapes the scheduler may send (prefill, decode, verify), then the self-check.

        Returns None when the model's steps are batch invariant, else why not (see
        ModelEngine.self_check): then a verify row may differ from the decode step it stands
        for, and the worker must serve without speculation.
        """
        cfg = self._config
        forward = self._engine.forward
        prompt_len = min(cfg.max_num_batched_tokens, cfg.max_model_len)
        forward([SeqSpan(0, 0, [0] * prompt_len, 1)])
        num_verify = min(cfg.max_draft_tokens + 1, cfg.max_model_len - 1)
        forward([SeqSpan(slot, 0, [0], 1) for slot in range(cfg.num_kv_slots)])
        forward([SeqSpan(slot, 1, [0] * num_verify, num_verify) for slot in range(cfg.num_kv_slots)])
        return self._engine.self_check()

    # ------------------------------------------------------------------ serving

    def release(self, slots: list[int]) -> None:
        for slot in slots:
            self._slots.release(slot)

    def execute(self, seqs: list[SeqWork], return_features: bool = False) -> tuple[list[SeqOutput], list[SeqFeatures]]:
        """Run one step; raises SlotError, before touching any state, if it is inconsistent.

        A sampling sequence with k draft tokens gets k+1 rows of logits (after its last
        accepted token and after each draft token); the accepted drafts and one more token
        come back, and its slot is cut back to the tokens that stand. With
        `return_features`, so do the final hidden states of the step's tokens that stand.
        """
        self._check(seqs)
        spans = [SeqSpan(w.slot, w.start_position, w.token_ids, w.num_draft_tokens + 1 if w.sample else 0,
                         None if w.draft_parents is None else tuple(w.draft_parents)) for w in seqs]
        logits, hidden = self._engine.forward_with_features(spans)  # logits [M, V]: the sampling rows, in step order
        best = torch.argmax(logits, dim=-1).tolist()  # one batched argmax serves every greedy sequence
        outputs: list[SeqOutput] = []
        features: list[SeqFeatures] = []
        row = 0
        token_row = 0  # the sequence's first row in `hidden`
        for w in seqs:
            num_drafts = w.num_draft_tokens
            num_standing = len(w.token_ids) - num_drafts
            branch: list[int] | None = None  # a tree's accepted nodes, when they are not its first ones
            if w.sample:
                drafts = w.token_ids[num_standing:]
                rows = slice(row, row + num_drafts + 1)
                parents = parents_or_chain(w.draft_parents, num_drafts)
                if w.sampling.is_greedy:
                    verdict, accepted = verify_tree_greedy(best[rows], drafts, parents)
                elif w.draft_dists is None:  # point masses (lookups): the target's own draws, as plain sampling's
                    verdict, accepted = verify_tree_sampled(logits[rows], drafts, parents, w.sampling,
                                                            w.start_position + num_standing)
                else:  # a sampled chain: its first nodes
                    verdict = verify(logits[rows], drafts, w.draft_dists, w.sampling, w.start_position + num_standing)
                    accepted = list(range(verdict.num_accepted))
                row += num_drafts + 1
                outputs.append(SeqOutput(w.request_id, verdict.token_ids, accepted))
                if leading_nodes(accepted) < len(accepted):  # the branch's keys and values go where it stands
                    branch = accepted
                    first = w.start_position + num_standing
                    self._engine.move_positions(w.slot, [first + node for node in branch], first)
                num_standing += verdict.num_accepted
            # Rejected drafts' keys and values stay behind the slot's length and are overwritten later.
            self._slots.set_length(w.slot, w.start_position + num_standing)
            if return_features:
                if branch is None:
                    kept = hidden[token_row : token_row + num_standing]
                else:
                    given = num_standing - len(branch)
                    kept = hidden[[token_row + i for i in range(given)] + [token_row + given + node for node in branch]]
                features.append(SeqFeatures(w.request_id, to_rows(kept, w.start_position)))
            token_row += len(w.token_ids)
        return outputs, features

    def _check(self, seqs: list[SeqWork]) -> None:
        seen: set[int] = set()
        vocab = self._model_config.vocab_size
        for w in seqs:
            if w.slot in seen:
                raise SlotError(f"slot {w.slot} appears twice in one step")
            seen.add(w.slot)
            self._slots.check_append(w.slot, w.start_position, len(w.token_ids))
            if any(not 0 <= t < vocab for t in w.token_ids):
                raise SlotError(f"request {w.request_id}: a token id is outside the vocabulary 0..{vocab - 1}")
            self._check_drafts(w)

    def _check_drafts(self, w: SeqWork) -> None:
        k = w.num_draft_tokens
        if k == 0 and w.draft_dists is None:
            return
        if not w.sample or not 0 <= k < len(w.token_ids) or k > self._config.max_draft_tokens:
            raise SlotError(f"request {w.request_id}: {k} draft tokens in a step of {len(w.token_ids)} tokens "
                            f"(sample={w.sample}, --max-draft-tokens {self._config.max_draft_tokens})")
        drafts = w.token_ids[len(w.token_ids) - k:]
        if problem := drafts_problem(drafts, w.draft_parents, w.draft_dists, self._model_config.vocab_size):
            raise SlotError(f"request {w.request_id}: {problem}")
