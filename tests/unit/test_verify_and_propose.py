"""Verification on the target runner and proposals from the draft service's proposers, on a tiny random model.

The lossless property at this level: whatever the drafts, greedy verification gives the
tokens plain greedy decoding gives, and the rejected positions are left behind so that the next step
continues from exactly the accepted tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_service.model_proposer import ModelProposer
from draft_service.prompt_lookup import NgramProposer
from draft_service.proposer import ProposeInput
from draft_service.sequences import SequenceStore
from draft_service.testing_proposers import RandomProposer, ReplayProposer
from common.process_config import ProcessConfig
from gpu_worker.config import WorkerConfig
from gpu_worker.runner import ModelRunner
from modeling.model.config import ModelConfig
from modeling.model.batch import PageError
from modeling.model.kv_cache import DEFAULT_PAGE_SIZE, pages_for_slots, slot_pages
from proto.messages import ProposeSeq, SamplingParams, SeqWork, SparseDist

GREEDY = SamplingParams()
PROMPT = [5, 17, 3, 88, 42, 7, 7, 1, 60, 33]


MAX_LEN = 128


def pages(slot: int) -> list[int]:
    """The block table of a fixed slot of MAX_LEN positions."""
    return list(slot_pages(slot, MAX_LEN))


def runner(folder: Path, num_slots: int = 4) -> ModelRunner:
    process = ProcessConfig(
        worker_id="w",
        scheduler_address="inproc://x",
        device="cpu",
        dtype="float32",
        heartbeat_interval_s=1.0,
        phase_timeout_s=60.0,
        step_timeout_s=60.0,
        drain_timeout_s=10.0,
        num_threads=0,
        status_file=None,
    )
    config = WorkerConfig(
        process=process,
        model=folder,
        max_model_len=MAX_LEN,
        kv_cache_memory_gib=None,
        page_size=DEFAULT_PAGE_SIZE,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_draft_tokens=6,
    )
    r = ModelRunner(config, ModelConfig.from_folder(folder), pages_for_slots(num_slots, MAX_LEN))
    r.load()
    r.allocate()
    return r


def plain_greedy(r: ModelRunner, slot: int, prompt: list[int], n: int, params: SamplingParams = GREEDY) -> list[int]:
    (out,), _, _ = r.execute([SeqWork("p", pages(slot), 0, prompt, True, params)])
    tokens = list(out.token_ids)
    while len(tokens) < n:
        (out,), _, _ = r.execute([SeqWork("p", pages(slot), len(prompt) + len(tokens) - 1, [tokens[-1]], True, params)])
        tokens += out.token_ids
    return tokens


def speculative(
    r: ModelRunner, slot: int, prompt: list[int], n: int, propose, params: SamplingParams = GREEDY
) -> tuple[list[int], int]:
    """Decode with drafts from propose(sequence) -> list of tokens; returns (tokens, num_accepted)."""
    (out,), _, _ = r.execute([SeqWork("s", pages(slot), 0, prompt, True, params)])
    tokens = list(out.token_ids)
    num_accepted = 0
    while len(tokens) < n:
        drafts = propose(prompt + tokens)[: n - len(tokens) - 1]
        (out,), _, _ = r.execute(
            [
                SeqWork(
                    "s",
                    pages(slot),
                    len(prompt) + len(tokens) - 1,
                    [tokens[-1], *drafts],
                    True,
                    params,
                    num_draft_tokens=len(drafts),
                )
            ]
        )
        assert out.token_ids[: out.num_accepted_draft] == drafts[: out.num_accepted_draft]
        assert len(out.token_ids) == out.num_accepted_draft + 1
        num_accepted += out.num_accepted_draft
        tokens += out.token_ids
    return tokens, num_accepted


def test_greedy_verification_equals_plain_greedy_with_right_wrong_and_partly_right_drafts(
    tiny_llama_folder: Path,
) -> None:
    r = runner(tiny_llama_folder)
    reference = plain_greedy(r, 0, PROMPT, 24)
    truth = PROMPT + reference
    right = lambda seq: truth[len(seq) : len(seq) + 4]  # noqa: E731
    wrong = lambda seq: [(t + 1) % 97 for t in truth[len(seq) : len(seq) + 4]]  # noqa: E731
    half = lambda seq: [t if i < 2 else (t + 1) % 97 for i, t in enumerate(truth[len(seq) : len(seq) + 5])]  # noqa: E731
    for propose, expect_accepted in ((right, True), (wrong, False), (half, True)):
        tokens, num_accepted = speculative(r, 1, PROMPT, 24, propose)
        assert tokens[:24] == reference
        assert (num_accepted > 0) == expect_accepted


def test_a_mixed_step_verifies_each_sequence_on_its_own_rows(tiny_llama_folder: Path) -> None:
    r = runner(tiny_llama_folder)
    reference = plain_greedy(r, 0, PROMPT, 6)
    other = [9, 8, 7, 6, 5]
    reference_other = plain_greedy(r, 0, other, 2)
    r.execute([SeqWork("a", pages(0), 0, PROMPT, True, GREEDY)])
    r.execute([SeqWork("b", pages(1), 0, other, True, GREEDY)])
    outputs, _, _ = r.execute(
        [
            SeqWork("b", pages(1), len(other), [reference_other[0]], True, GREEDY),  # plain decode
            SeqWork("a", pages(0), len(PROMPT), [reference[0], *reference[1:4]], True, GREEDY, num_draft_tokens=3),
            SeqWork("c", pages(2), 0, [1, 2, 3], False, GREEDY),  # a prefill chunk
        ]
    )
    assert [o.request_id for o in outputs] == ["b", "a"]
    assert outputs[0].token_ids == [reference_other[1]]
    assert (outputs[1].token_ids, outputs[1].num_accepted_draft) == (reference[1:5], 3)


def test_sampled_verification_is_reproducible_and_equals_plain_sampling_without_drafts(tiny_llama_folder: Path) -> None:
    r = runner(tiny_llama_folder)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234)
    plain = plain_greedy(r, 0, PROMPT, 12, params)
    nothing = lambda seq: []  # noqa: E731
    assert speculative(r, 1, PROMPT, 12, nothing, params)[0] == plain  # k = 0 is plain sampling, draw for draw
    random_drafts = RandomProposer(97)
    propose = lambda seq: random_drafts.propose([ProposeInput("s", seq, 0, 4, params)])[0].token_ids  # noqa: E731
    first = speculative(r, 1, PROMPT, 12, propose, params)
    second = speculative(r, 2, PROMPT, 12, propose, params)
    assert first == second


def test_inconsistent_draft_fields_are_refused_before_anything_runs(tiny_llama_folder: Path) -> None:
    r = runner(tiny_llama_folder)
    bad = [
        SeqWork("a", pages(0), 0, PROMPT, False, GREEDY, num_draft_tokens=2),  # drafts without sampling
        SeqWork("a", pages(0), 0, PROMPT, True, GREEDY, num_draft_tokens=len(PROMPT)),  # no standing token
        SeqWork("a", pages(0), 0, PROMPT, True, GREEDY, num_draft_tokens=7),  # over --max-draft-tokens
        SeqWork("a", pages(0), 0, PROMPT, True, GREEDY, num_draft_tokens=1, draft_dists=[]),
        SeqWork("a", pages(0), 0, PROMPT, True, GREEDY, num_draft_tokens=1, draft_dists=[SparseDist([500], [1.0])]),
        SeqWork("a", pages(0), 0, PROMPT, True, GREEDY, num_draft_tokens=1, draft_dists=[SparseDist([5], [1.5])]),
    ]
    for work in bad:
        with pytest.raises(PageError):
            r.execute([work])


# ---------------------------------------------------------------- proposers


def test_ngram_proposes_the_continuation_of_the_latest_earlier_occurrence() -> None:
    ngram = NgramProposer(ngram_min=2, ngram_max=3)
    assert ngram.lookup([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 2) == [8, 5]  # the latest match wins
    assert ngram.lookup([1, 2, 3, 4, 7, 3, 4], 3) == [7, 3, 4]  # n = 2 when 3 finds nothing
    assert ngram.lookup([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert ngram.lookup([4, 4, 4], 5) == [4]  # runs up to the end of the sequence
    assert (
        NgramProposer(ngram_min=3, ngram_max=3).lookup([1, 2, 7, 3, 1, 2], 2) == []
    )  # n below ngram_min is never tried
    assert ngram.lookup([], 2) == [] and ngram.lookup([1], 2) == []


def test_sequence_store_drops_then_appends_and_restarts_on_a_count_mismatch() -> None:
    store = SequenceStore()
    first = store.update(ProposeSeq("a", 0, 0, [1, 2, 3], 2, GREEDY))
    assert (first.token_ids, first.num_stable, first.restarted) == ([1, 2, 3], 0, False)
    store.record_proposal("a", [4, 5])
    second = store.update(ProposeSeq("a", 5, 1, [9], 2, GREEDY))  # 4 accepted, 5 rejected, 9 came instead
    assert (second.token_ids, second.num_stable) == ([1, 2, 3, 4, 9], 4)
    store.record_proposal("a", [])
    assert store.update(ProposeSeq("a", 7, 0, [1], 2, GREEDY)).restarted  # it holds 5, not 7
    assert len(store) == 0
    assert store.update(ProposeSeq("a", 0, 0, [1, 2], 2, GREEDY)).token_ids == [1, 2]
    assert store.forget("a") and not store.forget("a")


def test_sequence_store_keeps_the_feature_rows_that_stand_as_they_grow_and_are_cut_back() -> None:
    """Rows arrive in pieces, some after a cut-back (rejected drafts); the store always holds rows 0..n-1 as sent."""
    from modeling.model.features import to_rows

    store = SequenceStore()
    expected = torch.randn(3, 4)
    update = store.update(ProposeSeq("a", 0, 0, [1, 2, 3], 2, GREEDY, features=to_rows(expected, 0)))
    assert update.features is not None and torch.equal(update.features, expected)
    generator = torch.Generator().manual_seed(0)
    for start, num_rows in [(3, 2), (5, 1), (4, 3), (7, 40), (20, 1)]:  # growing past the buffer, and cutting back
        rows = torch.randn(num_rows, 4, generator=generator)
        expected = torch.cat((expected[:start], rows))
        held = len(update.token_ids)
        store.record_proposal("a", [])
        update = store.update(ProposeSeq("a", held, 0, [7] * num_rows, 2, GREEDY, features=to_rows(rows, start)))
        assert not update.restarted and update.features is not None
        assert torch.equal(update.features, expected), f"rows after writing {num_rows} at {start}"
    gap = store.update(
        ProposeSeq("a", len(update.token_ids), 0, [7], 2, GREEDY, features=to_rows(torch.randn(1, 4), 30))
    )
    assert gap.restarted  # rows past what is held cannot stand: start over
    assert len(store) == 0


def test_replay_proposes_the_reference_continuation(tmp_path: Path) -> None:
    path = tmp_path / "refs.json"
    path.write_text("[[1, 2, 3, 4, 5, 6], [1, 2, 9, 9]]")
    replay = ReplayProposer(path)
    replay.phases()[0]()
    out = replay.propose(
        [
            ProposeInput("a", [1, 2, 3], 0, 2, GREEDY),
            ProposeInput("b", [1, 2, 9], 0, 4, GREEDY),
            ProposeInput("c", [7], 0, 2, GREEDY),
        ]
    )
    assert [p.token_ids for p in out] == [[4, 5], [9], []]


def model_proposer(folder: Path, num_slots: int = 4) -> ModelProposer:
    proposer = ModelProposer(
        folder, device="cpu", dtype="float32", num_seqs=num_slots, max_len=MAX_LEN, max_draft_tokens=4, draft_top_k=8
    )
    for phase in proposer.phases():
        phase()
    return proposer


def test_the_draft_models_kv_follows_the_sequence_through_drops(tiny_llama_folder: Path) -> None:
    """Incremental proposals (cut back after rejections) equal those of a fresh proposer for the same sequence."""
    incremental = model_proposer(tiny_llama_folder)
    store = SequenceStore()
    sequence = list(PROMPT)
    held, proposal = 0, 0
    new = list(PROMPT)
    for round_ in range(6):
        update = store.update(ProposeSeq("a", held, proposal, new, 4, GREEDY))
        (made,) = incremental.propose([ProposeInput("a", update.token_ids, update.num_stable, 4, GREEDY)])
        fresh = model_proposer(tiny_llama_folder)
        (expected,) = fresh.propose([ProposeInput("a", update.token_ids, 0, 4, GREEDY)])
        assert made.token_ids == expected.token_ids and len(made.token_ids) == 4
        store.record_proposal("a", made.token_ids)
        accepted = round_ % 3  # 0, 1 or 2 of the 4 accepted, then a token of "the target's"
        sequence += made.token_ids[:accepted] + [(round_ * 13) % 97]
        held, proposal = len(update.token_ids) + 4, 4 - accepted
        new = sequence[len(update.token_ids) + accepted :]
    incremental.forget("a")
    assert incremental.num_used_kv_pages == 0


def test_a_sampled_draft_sends_the_truncated_distribution_it_drew_from(tiny_llama_folder: Path) -> None:
    proposer = model_proposer(tiny_llama_folder)
    params = SamplingParams(temperature=1.0, seed=7)
    (made,) = proposer.propose([ProposeInput("a", PROMPT, 0, 3, params)])
    assert made.dists is not None and len(made.dists) == len(made.token_ids) == 3
    for token, dist in zip(made.token_ids, made.dists):
        assert token in dist.token_ids and 0 < len(dist.token_ids) <= 8
        assert sum(dist.probs) == pytest.approx(1.0, abs=1e-5)
    again = model_proposer(tiny_llama_folder).propose([ProposeInput("a", PROMPT, 0, 3, params)])[0]
    assert again.token_ids == made.token_ids  # seeded


def test_sequences_beyond_the_draft_slots_get_no_proposal(tiny_llama_folder: Path) -> None:
    proposer = model_proposer(tiny_llama_folder, num_slots=2)
    out = proposer.propose([ProposeInput(rid, PROMPT, 0, 2, GREEDY) for rid in "abc"])
    assert [len(p.token_ids) for p in out] == [2, 2, 0]
    proposer.forget("a")
    assert len(proposer.propose([ProposeInput("c", PROMPT, 0, 2, GREEDY)])[0].token_ids) == 2


def test_a_step_returns_the_features_of_the_tokens_that_stand(tiny_llama_folder: Path) -> None:
    """Prefill chunk: every row; decode: its row; verify: the last token and the accepted drafts, not the rejected."""
    from modeling.model.features import from_rows

    r = runner(tiny_llama_folder)
    reference = plain_greedy(r, 0, PROMPT, 6)
    _, prefill, _ = r.execute([SeqWork("a", pages(1), 0, PROMPT, True, GREEDY)], return_features=True)
    (rows,) = prefill
    assert (rows.request_id, rows.rows.start_position, rows.rows.num_rows, rows.rows.width) == ("a", 0, len(PROMPT), 64)
    wrong = (reference[2] + 1) % 97
    outputs, verify, _ = r.execute(
        [
            SeqWork(
                "a",
                pages(1),
                len(PROMPT),
                [reference[0], reference[1], wrong, reference[3]],
                True,
                GREEDY,
                num_draft_tokens=3,
            )
        ],
        return_features=True,
    )
    assert outputs[0].num_accepted_draft == 1
    (rows,) = verify
    assert (rows.rows.start_position, rows.rows.num_rows) == (len(PROMPT), 2)  # the last token and one accepted draft
    # The same features as one prefill of the whole sequence computes (float32: equal up to summation order).
    _, (whole,), _ = runner(tiny_llama_folder).execute(
        [SeqWork("z", pages(0), 0, PROMPT + reference[:2], True, GREEDY)], return_features=True
    )
    expected = from_rows(whole.rows)
    got = torch.cat((from_rows(prefill[0].rows), from_rows(rows.rows)))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    _, nothing, _ = r.execute([SeqWork("a", pages(1), len(PROMPT) + 2, [reference[2]], True, GREEDY)])
    assert nothing == []  # not asked for


# ---------------------------------------------------------------- token trees


def _tree_around(truth: list[int], offset: int) -> tuple[list[int], list[int]]:
    """A tree whose right branch holds `truth` below a wrong first guess and beside wrong guesses:
    nodes [wrong, truth[0], wrong under truth[0], truth[1], truth[2], ...]."""
    wrong = lambda token: (token + offset) % 97  # noqa: E731
    tokens = [wrong(truth[0]), truth[0], wrong(truth[1])]
    parents = [-1, -1, 1]
    for depth, token in enumerate(truth[1:], start=1):
        tokens.append(token)
        parents.append(1 if depth == 1 else len(tokens) - 2)
    return tokens, parents


def test_greedy_tree_verification_equals_plain_greedy_and_moves_the_accepted_branch(tiny_llama_folder: Path) -> None:
    """The accepted branch lies behind rejected nodes in the cache; it is moved to where the sequence goes on, so every
    later step still gives plain greedy's tokens."""
    r = runner(tiny_llama_folder)
    reference = plain_greedy(r, 0, PROMPT, 24)
    (out,), _, _ = r.execute([SeqWork("t", pages(1), 0, PROMPT, True, GREEDY)])
    tokens = list(out.token_ids)
    accepted = 0
    for cycle in range(6):
        truth = reference[len(tokens) : len(tokens) + 3]
        if cycle % 2:
            truth[-1] = (truth[-1] + 1) % 97  # the last guess of the branch wrong: a shorter accepted branch
        drafts, parents = _tree_around(truth, 3 + cycle)
        (out,), _, _ = r.execute(
            [
                SeqWork(
                    "t",
                    pages(1),
                    len(PROMPT) + len(tokens) - 1,
                    [tokens[-1], *drafts],
                    True,
                    GREEDY,
                    num_draft_tokens=len(drafts),
                    draft_parents=parents,
                )
            ]
        )
        assert out.num_accepted_draft == (2 if cycle % 2 else 3)
        accepted += out.num_accepted_draft
        tokens += out.token_ids
    while len(tokens) < len(reference):
        (out,), _, _ = r.execute([SeqWork("t", pages(1), len(PROMPT) + len(tokens) - 1, [tokens[-1]], True, GREEDY)])
        tokens += out.token_ids
    assert tokens[: len(reference)] == reference
    assert accepted == 15


def test_a_tree_returns_the_features_of_its_accepted_branch(tiny_llama_folder: Path) -> None:
    from modeling.model.features import from_rows

    r = runner(tiny_llama_folder)
    reference = plain_greedy(r, 0, PROMPT, 6)
    r.execute([SeqWork("a", pages(1), 0, PROMPT, True, GREEDY)])
    drafts, parents = _tree_around(reference[1:3], 5)
    outputs, (rows,), _ = r.execute(
        [
            SeqWork(
                "a",
                pages(1),
                len(PROMPT),
                [reference[0], *drafts],
                True,
                GREEDY,
                num_draft_tokens=len(drafts),
                draft_parents=parents,
            )
        ],
        return_features=True,
    )
    assert outputs[0].token_ids == reference[1:4] and outputs[0].num_accepted_draft == 2
    assert (rows.rows.start_position, rows.rows.num_rows) == (len(PROMPT), 3)  # the last token and the branch's two
    _, (whole,), _ = runner(tiny_llama_folder).execute(
        [SeqWork("z", pages(0), 0, PROMPT + reference[:3], True, GREEDY)], return_features=True
    )
    torch.testing.assert_close(from_rows(rows.rows), from_rows(whole.rows)[len(PROMPT) :], atol=1e-4, rtol=1e-4)


def test_sampled_tree_verification_gives_plain_samplings_tokens(tiny_llama_folder: Path) -> None:
    """Point-mass drafts, chain or tree, right or wrong: every token is the target's own seeded draw at its position."""
    r = runner(tiny_llama_folder)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=99)
    reference = plain_greedy(r, 0, PROMPT, 24, params)  # (plain sampling, despite the helper's name)
    (out,), _, _ = r.execute([SeqWork("s", pages(1), 0, PROMPT, True, params)])
    tokens = list(out.token_ids)
    accepted = 0
    for cycle in range(8):
        truth = reference[len(tokens) : len(tokens) + 3]
        if len(truth) < 3:
            break
        drafts, parents = _tree_around(truth, 3 + cycle)
        if cycle % 3 == 2:
            drafts, parents = truth[:2] + [(truth[2] + 1) % 97], None  # a chain whose last guess is wrong
        (out,), _, _ = r.execute(
            [
                SeqWork(
                    "s",
                    pages(1),
                    len(PROMPT) + len(tokens) - 1,
                    [tokens[-1], *drafts],
                    True,
                    params,
                    num_draft_tokens=len(drafts),
                    draft_parents=parents,
                )
            ]
        )
        accepted += out.num_accepted_draft
        tokens += out.token_ids
    while len(tokens) < len(reference):
        (out,), _, _ = r.execute([SeqWork("s", pages(1), len(PROMPT) + len(tokens) - 1, [tokens[-1]], True, params)])
        tokens += out.token_ids
    assert tokens[: len(reference)] == reference
    assert accepted >= 8  # the branches that hold the truth were followed


def test_a_tree_is_refused_unless_of_point_masses_and_well_formed(tiny_llama_folder: Path) -> None:
    r = runner(tiny_llama_folder)
    sampled = SamplingParams(temperature=0.8, seed=1)
    bad = [
        SeqWork(
            "a",
            pages(0),
            0,
            PROMPT,
            True,
            sampled,
            num_draft_tokens=2,
            draft_parents=[-1, -1],
            draft_dists=[SparseDist([5], [1.0]), SparseDist([6], [1.0])],
        ),  # with distributions
        SeqWork("a", pages(0), 0, PROMPT, True, GREEDY, num_draft_tokens=2, draft_parents=[-1]),  # one parent short
        SeqWork(
            "a", pages(0), 0, PROMPT, True, GREEDY, num_draft_tokens=2, draft_parents=[1, -1]
        ),  # a parent after its child
        SeqWork("a", pages(0), 0, PROMPT, True, GREEDY, num_draft_tokens=2, draft_parents=[-1, -2]),
    ]
    for work in bad:
        with pytest.raises(PageError):
            r.execute([work])
