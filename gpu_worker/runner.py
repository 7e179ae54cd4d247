"""Runs steps on one model replica: checks them against the KV pages, forwards, samples."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from gpu_worker.config import WorkerConfig
from common.step_shape import step_shape
from modeling.model.batch import SeqSpan
from modeling.model.config import ModelConfig
from modeling.model.engine import ModelEngine
from modeling.model.features import to_rows
from modeling.model.graphs import GraphBackend
from modeling.model.batch import PageError
from modeling.model.kv_cache import pages_for
from modeling.sampling.logprobs import token_logprobs
from modeling.sampling.penalties import penalize_rows
from common.text.structured import grammar_tokenizer
from common.text.tokenizer import Tokenizer
from gpu_worker.grammars import GrammarFailure, GrammarMasks
from common.draft_rules import drafts_problem
from modeling.sampling.rejection import verify, verify_tree_greedy, verify_tree_sampled
from common.trees import branch_to, leading_nodes, parents_or_chain
from proto.messages import MAX_TOP_LOGPROBS, Penalties, PromptLogprobs, SeqFeatures, SeqOutput, SeqWork, StepTiming


_WARM_UP_TIMINGS = 3  # runs of each timed shape; the median is reported
_WARM_UP_ROWS = 32  # sequences in the warm-up's decode and verify steps at most (more only lengthen the start)
_GRAMMARS_PER_SEQ = 4  # grammar matchers kept per sequence the worker may run (a cache: more are rebuilt)


class ModelRunner:
    """The target model and its paged KV cache, built in phases by the worker.

    The scheduler decides which page holds what; every step names each sequence's pages,
    and the runner checks that they exist, reach far enough and are written by one
    sequence only, so a confused scheduler gets an error instead of one sequence
    silently overwriting another's keys.
    """

    def __init__(self, config: WorkerConfig, model_config: ModelConfig, num_pages: int) -> None:
        self._config = config
        self._model_config = model_config
        self._num_pages = num_pages
        self._engine = ModelEngine(
            config.model,
            model_config,
            device=config.process.device,
            dtype=config.process.dtype,
            num_pages=num_pages,
            max_len=config.max_model_len,
            page_size=config.page_size,
            quantization=config.quantization,
        )
        self._grammars = GrammarMasks(
            self._grammar_tokenizer, model_config.vocab_size, _GRAMMARS_PER_SEQ * config.max_num_seqs
        )

    # ------------------------------------------------------------------ phases

    def load(self) -> None:
        self._engine.load()

    @property
    def native(self) -> bool:
        """Whether the loaded model runs on the native CPU kernels."""
        return self._engine.native

    @property
    def ops(self) -> str:
        """Which ops the loaded model runs on, and why."""
        return self._engine.ops

    def allocate(self) -> None:
        self._engine.allocate(scratch_page=self._config.cuda_graphs != "off")

    def capture_graphs(self, backend: GraphBackend, before_each: Callable[[int], None]) -> tuple[int, float]:
        """Capture the decode and verify steps' graphs at every bucket this worker's steps may take (after the
        self-check: a broken model is reported as such, not as a failed capture); raises CaptureFailed. Returns how
        many, and the seconds it took."""
        cfg = self._config
        seconds = self._engine.capture_graphs(backend, cfg.max_num_seqs, cfg.max_draft_tokens + 1, before_each)
        assert self._engine.graphs is not None
        return self._engine.graphs.num_graphs, seconds

    def warm_up(self) -> tuple[str | None, list[StepTiming]]:
        """Forward passes at the largest shapes the scheduler may send (prefill, decode, verify), timed, then the
        self-check.

        Returns why the model's steps are not batch invariant (None when they are; see
        ModelEngine.self_check: then a verify row may differ from the decode step it stands
        for), and the time of a few step shapes, so that the scheduler knows what rows cost
        before it ever speculates (scheduler/speculation/cost.py).
        """
        cfg = self._config
        size = cfg.page_size
        prompt_len = min(cfg.max_num_batched_tokens, cfg.max_model_len, self._num_pages * size)
        num_verify = min(cfg.max_draft_tokens + 1, cfg.max_model_len - 1)
        per_row = pages_for(1 + num_verify, size)
        # Warm-up rows may share pages (a small pool): what they write is never read as anyone's.
        tables = [
            tuple((row * per_row + i) % self._num_pages for i in range(per_row))
            for row in range(min(cfg.max_num_seqs, _WARM_UP_ROWS))
        ]
        long_table = tuple(range(pages_for(prompt_len, size)))
        shapes = [
            [SeqSpan(long_table, 0, [0] * prompt_len, 1)],
            [SeqSpan(table, 0, [0], 1) for table in tables],
            [SeqSpan(table, 1, [0] * num_verify, num_verify) for table in tables],
            [SeqSpan(tables[0], 1, [0], 1)],
            [SeqSpan(tables[0], 1, [0] * num_verify, num_verify)],
        ]
        if prompt_len > 2 * num_verify:
            # The same rows after the prompt's positions: what attending to a long context costs, apart from the rows
            # (with short contexts alone the two move together, and the fit cannot tell them apart).
            shapes += [
                [SeqSpan(long_table, prompt_len - 1, [0], 1)],
                [SeqSpan(long_table, prompt_len - num_verify, [0] * num_verify, num_verify)],
            ]
        for spans in shapes:
            self._engine.forward(spans)
        # After a first run of each (its first-run costs left out), the median of a few: the scheduler keeps these for
        # good, and one run on a shared machine may have lost its core.
        runs = [[self._timed(spans) for spans in shapes[1:]] for _ in range(_WARM_UP_TIMINGS)]
        timings = [sorted(times, key=lambda t: t.duration_ms)[len(times) // 2] for times in zip(*runs)]
        return self._engine.self_check(), timings

    def _timed(self, spans: list[SeqSpan]) -> StepTiming:
        started = time.perf_counter()
        self._engine.forward(spans)
        if self._config.process.device.startswith("cuda"):
            torch.cuda.synchronize()
        duration_ms = (time.perf_counter() - started) * 1000
        shape = step_shape(
            [
                (len(s.token_ids), 0, s.start, False) if s.start == 0 else (1, len(s.token_ids) - 1, s.start, False)
                for s in spans
            ]
        )
        return StepTiming(shape.decode_rows, shape.prefill_tokens, shape.attended, duration_ms)

    # ------------------------------------------------------------------ serving

    def _grammar_tokenizer(self):  # type: ignore[no-untyped-def]
        tokenizer = Tokenizer.load(self._config.model)
        return grammar_tokenizer(tokenizer.backend_json(), self._model_config.vocab_size, tokenizer.eos_token_ids)

    def execute(
        self, seqs: list[SeqWork], return_features: bool = False
    ) -> tuple[list[SeqOutput], list[SeqFeatures], list[PromptLogprobs]]:
        """Run one step; raises PageError, before touching any state, if it is inconsistent.

        A sampling sequence with k draft tokens gets k+1 rows of logits (after its last
        accepted token and after each draft token); the accepted drafts and one more token
        come back, with their log-probabilities when asked. A sequence that asks for prompt
        log-probabilities gets a row after each of its tokens, and those of the tokens that
        follow come back. The keys and values of rejected drafts stay in pages past the
        tokens that stand (the scheduler releases or overwrites them). With
        `return_features`, so do the final hidden states of the step's tokens that stand.
        """
        self._check(seqs)
        masks = self._grammar_masks(seqs)
        spans = [
            SeqSpan(
                tuple(w.pages),
                w.start_position,
                w.token_ids,
                _num_logit_rows(w),
                None if w.draft_parents is None else tuple(w.draft_parents),
            )
            for w in seqs
        ]
        # Logits [M, V]: the rows asked for, in step order; widened to float32 only for what reads more than their
        # argmax (sampling, log-probabilities; penalties and grammars widen them in _constrained): widening is a copy
        # of all a step's [rows, vocabulary] logits, as large as the LM head's output.
        widen = any(
            w.prompt_logprobs >= 0 or (w.sample and (not w.sampling.is_greedy or w.logprobs >= 0)) for w in seqs
        )
        logits, hidden = self._engine.forward_with_features(spans, widen_logits=widen)
        logits = self._constrained(seqs, logits, masks)
        best = self._engine.greedy_tokens(logits)  # one batched argmax serves every greedy sequence
        outputs: list[SeqOutput] = []
        features: list[SeqFeatures] = []
        prompt_logprobs: list[PromptLogprobs] = []
        row = 0
        token_row = 0  # the sequence's first row in `hidden`
        for w in seqs:
            num_drafts = w.num_draft_tokens
            num_standing = len(w.token_ids) - num_drafts
            branch: list[int] | None = None  # a tree's accepted nodes, when they are not its first ones
            if w.prompt_logprobs >= 0:
                prompt_logprobs.append(self._prompt_logprobs(w, logits[row : row + num_standing]))
                row += _num_logit_rows(w) - (num_drafts + 1 if w.sample else 0)
            if w.sample:
                drafts = w.token_ids[num_standing:]
                rows = slice(row, row + num_drafts + 1)
                parents = parents_or_chain(w.draft_parents, num_drafts)
                if w.sampling.is_greedy:
                    verdict, accepted = verify_tree_greedy(best[rows], drafts, parents)
                elif w.draft_dists is None:  # point masses (lookups): the target's own draws, as plain sampling's
                    verdict, accepted = verify_tree_sampled(
                        logits[rows], drafts, parents, w.sampling, w.start_position + num_standing
                    )
                else:  # a sampled chain: its first nodes
                    verdict = verify(logits[rows], drafts, w.draft_dists, w.sampling, w.start_position + num_standing)
                    accepted = list(range(verdict.num_accepted))
                row += num_drafts + 1
                logprobs = None
                if w.logprobs >= 0:  # token j was drawn at row 0, or after node accepted[j - 1]
                    token_rows = [rows.start] + [rows.start + 1 + node for node in accepted]
                    logprobs = token_logprobs(logits[token_rows], verdict.token_ids, w.logprobs, w.sampling.temperature)
                forced, complete = self._after_grammar(w, verdict.token_ids)
                outputs.append(SeqOutput(w.request_id, verdict.token_ids, accepted, logprobs, forced, complete))
                if leading_nodes(accepted) < len(accepted):  # the branch's keys and values go where it stands
                    branch = accepted
                    first = w.start_position + num_standing
                    self._engine.move_positions(tuple(w.pages), [first + node for node in branch], first)
                num_standing += verdict.num_accepted
            if return_features:
                if branch is None:
                    kept = hidden[token_row : token_row + num_standing]
                else:
                    given = num_standing - len(branch)
                    kept = hidden[[token_row + i for i in range(given)] + [token_row + given + node for node in branch]]
                features.append(SeqFeatures(w.request_id, to_rows(kept, w.start_position)))
            token_row += len(w.token_ids)
        return outputs, features, prompt_logprobs

    def _grammar_masks(self, seqs: list[SeqWork]) -> dict[str, list[torch.Tensor | None]]:
        """Each grammar-following sequence's sampling-row masks (gpu_worker/grammars.py), before anything is written."""
        masks: dict[str, list[torch.Tensor | None]] = {}
        for w in seqs:
            if w.sample and w.grammar is not None:
                try:
                    masks[w.request_id] = self._grammars.row_masks(w)
                except GrammarFailure as error:
                    raise PageError(f"request {w.request_id}: {error}", request_id=w.request_id) from error
        return masks

    def _after_grammar(self, w: SeqWork, token_ids: list[int]) -> tuple[list[int], bool]:
        """The tokens the grammar forces next, as many as a step may verify (a long forced string would make the step's
        result larger than the scheduler takes, proto/frames.py), and whether it is complete."""
        if w.grammar is None:
            return [], False
        try:
            forced, complete = self._grammars.after_step(w.request_id, token_ids)
            return forced[: self._config.max_draft_tokens], complete
        except GrammarFailure as error:
            raise PageError(f"request {w.request_id}: {error}", request_id=w.request_id) from error

    def _constrained(
        self, seqs: list[SeqWork], logits: torch.Tensor, masks: dict[str, list[torch.Tensor | None]]
    ) -> torch.Tensor:
        """The logits with each sampling row of a sequence with penalties or a grammar changed after its own prefix:
        the tokens that stand, then its draft branch
        (modeling/sampling/penalties.py, then the grammar's mask). In float32 when
        any is (a widening: exact)."""
        if not masks and not any(w.sample and w.sampling.penalties is not None for w in seqs):
            return logits
        with torch.inference_mode():  # the logits are an inference tensor: changed in place only in this mode
            return self._constrain(seqs, logits.float(), masks)

    def _constrain(
        self, seqs: list[SeqWork], logits: torch.Tensor, masks: dict[str, list[torch.Tensor | None]]
    ) -> torch.Tensor:
        row = 0
        for w in seqs:
            num_rows = _num_logit_rows(w)
            first = row + num_rows - (w.num_draft_tokens + 1 if w.sample else 0)
            for offset, mask in enumerate(masks.get(w.request_id, [])):
                if mask is not None:
                    logits[first + offset].masked_fill_(~mask, float("-inf"))
            penalties = w.sampling.penalties
            if w.sample and penalties is not None:
                assert w.history is not None  # _check
                num_standing = len(w.token_ids) - w.num_draft_tokens
                standing = [*w.history, *w.token_ids[:num_standing]]
                drafts = w.token_ids[num_standing:]
                parents = parents_or_chain(w.draft_parents, len(drafts))
                prefixes = [standing] + [
                    standing + [drafts[n] for n in branch_to(parents, node)] for node in range(len(drafts))
                ]
                penalize_rows(logits[first : row + num_rows], prefixes, w.num_prompt_tokens, penalties)
            row += num_rows
        return logits

    def _prompt_logprobs(self, w: SeqWork, logits: torch.Tensor) -> PromptLogprobs:
        """The log-probabilities of the chunk's tokens after its first, then of after_token_id, from the rows after
        each of its standing tokens (`logits`)."""
        num_standing = len(w.token_ids) - w.num_draft_tokens
        following = list(w.token_ids[1:num_standing]) + ([w.after_token_id] if w.after_token_id >= 0 else [])
        entries = token_logprobs(logits[: len(following)], following, w.prompt_logprobs)
        return PromptLogprobs(w.request_id, w.start_position + 1, entries)

    def _check(self, seqs: list[SeqWork]) -> None:
        vocab = self._model_config.vocab_size
        size = self._config.page_size
        request_ids: set[str] = set()
        written: dict[int, str] = {}  # page -> the request writing it
        for w in seqs:
            if w.request_id in request_ids:
                raise PageError(f"request {w.request_id} appears twice in one step")
            request_ids.add(w.request_id)
            end = w.start_position + len(w.token_ids)
            if not w.token_ids or w.start_position < 0 or end > self._config.max_model_len:
                raise PageError(
                    f"request {w.request_id}: {len(w.token_ids)} new tokens at {w.start_position} do not fit "
                    f"in {self._config.max_model_len} positions"
                )
            if any(not 0 <= page < self._num_pages for page in w.pages):
                raise PageError(f"request {w.request_id}: a page is outside the cache's 0..{self._num_pages - 1}")
            if len(w.pages) * size < end:
                raise PageError(
                    f"request {w.request_id}: {len(w.pages)} pages of {size} positions cannot hold {end} positions"
                )
            if any(not 0 <= t < vocab for t in w.token_ids):
                raise PageError(
                    f"request {w.request_id}: a token id is outside the vocabulary 0..{vocab - 1}",
                    request_id=w.request_id,
                )
            for page in w.pages[w.start_position // size : pages_for(end, size)]:
                if written.setdefault(page, w.request_id) != w.request_id:
                    raise PageError(
                        f"page {page} is written by requests {written[page]} and {w.request_id} in one step"
                    )
            self._check_drafts(w)
            self._check_logprobs(w)
            self._check_penalties(w)
        for w in seqs:  # a page one sequence writes is read by no other
            for page in w.pages[: w.start_position // size]:
                if written.get(page, w.request_id) != w.request_id:
                    raise PageError(
                        f"page {page} is written by request {written[page]} while request {w.request_id} reads it"
                    )

    def _check_penalties(self, w: SeqWork) -> None:
        if not w.sample or (w.sampling.penalties is None and w.grammar is None):
            return
        vocab = self._model_config.vocab_size
        penalties = w.sampling.penalties or Penalties()
        num_standing = len(w.token_ids) - w.num_draft_tokens
        if (
            w.history is None
            or len(w.history) != w.start_position
            or not 0 <= w.num_prompt_tokens <= w.start_position + num_standing
        ):
            raise PageError(
                f"request {w.request_id}: penalties and grammars need the {w.start_position} tokens before "
                f"the step and where its prompt ends",
                request_id=w.request_id,
            )
        ids = [*w.history, *penalties.logit_bias, *penalties.stop_token_ids]
        if any(not 0 <= t < vocab for t in ids):
            raise PageError(
                f"request {w.request_id}: a token id of its penalties is outside the vocabulary 0..{vocab - 1}",
                request_id=w.request_id,
            )

    def _check_logprobs(self, w: SeqWork) -> None:
        if not -1 <= w.logprobs <= MAX_TOP_LOGPROBS or not -1 <= w.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise PageError(
                f"request {w.request_id}: logprobs {w.logprobs} and prompt_logprobs {w.prompt_logprobs} "
                f"must be -1 (none) to {MAX_TOP_LOGPROBS}",
                request_id=w.request_id,
            )
        if w.after_token_id >= 0 and (w.prompt_logprobs < 0 or w.after_token_id >= self._model_config.vocab_size):
            raise PageError(
                f"request {w.request_id}: after_token_id {w.after_token_id} without prompt_logprobs, or "
                f"outside the vocabulary",
                request_id=w.request_id,
            )

    def _check_drafts(self, w: SeqWork) -> None:
        k = w.num_draft_tokens
        if k == 0 and w.draft_dists is None:
            return
        if not w.sample or not 0 <= k < len(w.token_ids) or k > self._config.max_draft_tokens:
            raise PageError(
                f"request {w.request_id}: {k} draft tokens in a step of {len(w.token_ids)} tokens "
                f"(sample={w.sample}, --max-draft-tokens {self._config.max_draft_tokens})"
            )
        drafts = w.token_ids[len(w.token_ids) - k :]
        if problem := drafts_problem(drafts, w.draft_parents, w.draft_dists, self._model_config.vocab_size):
            raise PageError(f"request {w.request_id}: {problem}")


def _num_logit_rows(w: SeqWork) -> int:
    """Rows of logits a sequence needs: after each standing token for prompt log-probabilities, then k + 1 to sample."""
    num_sampling = w.num_draft_tokens + 1 if w.sample else 0
    if w.prompt_logprobs < 0:
        return num_sampling
    num_standing = len(w.token_ids) - w.num_draft_tokens
    return (
        num_standing + num_sampling - (1 if w.sample else 0)
    )  # the last standing token's row is also sampling's first
