"""Draft verification: greedy prefix matching, rejection sampling on hand-built logits, and the emitted frequencies."""

from __future__ import annotations

import pytest
import torch

from modeling.sampling.rejection import Verdict, verify, verify_greedy
from modeling.sampling.draw import sample, target_probs
from proto.messages import SamplingParams, SparseDist

# 99.9% quantiles of the chi-square distribution (scipy is not in the venv), keyed by degrees of freedom.
CHI_SQUARE_999 = {3: 16.27, 4: 18.47, 24: 51.18}


def _rows(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def _greedy(logits: torch.Tensor, drafts: list[int]) -> Verdict:
    return verify_greedy(torch.argmax(logits, dim=-1).tolist(), drafts)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, num_trials: int) -> tuple[float, int]:
    """Pearson's statistic of counts against probs and its degrees of freedom;
    cells with probability 0 must be empty."""
    probs = probs.double().flatten()
    counts = counts.double().flatten()
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the target gives probability 0"
    expected = probs[support] * num_trials
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    return statistic, int(support.sum()) - 1


# ---------------------------------------------------------------- greedy


def test_greedy_accepts_all_matching_drafts_and_adds_bonus() -> None:
    logits = _rows([0, 5, 1, 0, 0, 0], [0, 0, 0, 7, 1, 0], [2, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 3])
    assert _greedy(logits, [1, 3, 0]) == Verdict([1, 3, 0, 5], 3)


def test_greedy_first_draft_rejected_gives_argmax_of_row_0() -> None:
    logits = _rows([0, 5, 1, 0, 0, 0], [0, 0, 0, 7, 1, 0], [2, 0, 0, 0, 0, 1])
    assert _greedy(logits, [2, 3]) == Verdict([1], 0)


def test_greedy_mismatch_in_the_middle() -> None:
    """Drafts after the first mismatch are dropped even where they match their own row."""
    logits = _rows([0, 5, 1, 0, 0, 0, 0], [0, 0, 0, 7, 1, 0, 0], [2, 0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 4])
    assert _greedy(logits, [1, 3, 5]) == Verdict([1, 3, 0], 2)
    assert _greedy(logits, [1, 4, 0]) == Verdict([1, 3], 1)


def test_greedy_empty_draft_gives_argmax() -> None:
    logits = _rows([0, 1, 0, 0, 9, 0, 2, 0])
    assert _greedy(logits, []) == Verdict([4], 0)


def test_sampled_verification_refuses_a_greedy_request() -> None:
    """A greedy request's drafts are verified from the argmax, never by rejection sampling (no division by 0)."""
    logits = _rows([0, 5, 1, 0, 0, 0], [0, 0, 0, 7, 1, 0], [2, 0, 0, 0, 0, 1])
    dists = [SparseDist(token_ids=[1], probs=[1.0]), SparseDist(token_ids=[4], probs=[1.0])]
    with pytest.raises(ValueError, match="greedy"):
        verify(logits, [1, 4], dists, SamplingParams(temperature=0.0, seed=3), 3)


# ---------------------------------------------------------------- sampling, hand-built


def test_draft_with_target_probability_one_is_always_accepted() -> None:
    """top_k=1 makes p a point mass; a deterministic proposer that matches it is never rejected."""
    logits = _rows([0, 3, 1, 0, 0, 0], [1, 0, 0, 0, 2, 0], [0, 0, 0, 0, 0, 1])
    for seed in range(200):
        params = SamplingParams(temperature=1.0, top_k=1, seed=seed)
        assert verify(logits, [1, 4], None, params, seed) == Verdict([1, 4, 5], 2)


def test_draft_with_p_at_least_q_is_always_accepted() -> None:
    """p(x) = 0.5 >= q(x) = 0.3 at both positions: accepted whatever the uniform draw."""
    p = [0.5, 0.2, 0.1, 0.1, 0.05, 0.05]
    logits = torch.log(torch.tensor([p, p[::-1], p]))
    dists = [SparseDist(token_ids=[0, 1, 3], probs=[0.3, 0.5, 0.2]), SparseDist(token_ids=[5, 2], probs=[0.3, 0.7])]
    for seed in range(200):
        params = SamplingParams(temperature=1.0, seed=seed)
        verdict = verify(logits, [0, 5], dists, params, 7)
        assert verdict.num_accepted == 2 and verdict.token_ids[:2] == [0, 5]


def test_draft_masked_by_top_k_is_always_rejected() -> None:
    """p(x) = 0 after top-k: rejected every time, and the replacement is a top-k token other than x."""
    logits = _rows([4, 0, 3, 0, 1, 0, 2, 0], [0, 0, 0, 0, 0, 0, 0, 0])
    top_3 = {0, 2, 6}
    dists_options = [None, [SparseDist(token_ids=[4, 0, 2], probs=[0.6, 0.2, 0.2])]]
    replacements = set()
    for seed in range(200):
        params = SamplingParams(temperature=1.5, top_k=3, seed=seed)
        for dists in dists_options:
            verdict = verify(logits, [4], dists, params, 20)
            assert verdict.num_accepted == 0 and len(verdict.token_ids) == 1
            assert verdict.token_ids[0] in top_3
            replacements.add(verdict.token_ids[0])
    assert replacements == top_3  # every surviving token comes up


def test_rejection_in_the_middle_keeps_the_accepted_prefix() -> None:
    p = [0.5, 0.3, 0.1, 0.05, 0.03, 0.02]
    logits = torch.log(torch.tensor([p, p, p, p]))
    dists = [
        SparseDist(token_ids=[0], probs=[0.4]),
        SparseDist(token_ids=[1], probs=[0.2]),
        SparseDist(token_ids=[5], probs=[1.0]),  # a point mass on the draft token
    ]
    for seed in range(100):
        params = SamplingParams(temperature=1.0, top_k=3, seed=seed)
        verdict = verify(logits, [0, 1, 5], dists, params, 0)  # token 5 is outside the top 3
        assert verdict.num_accepted == 2
        assert verdict.token_ids[:2] == [0, 1] and verdict.token_ids[2] in {0, 1, 2}


def test_replacement_for_a_masked_draft_is_the_plain_draw_at_that_position() -> None:
    """When p(x) = 0 and q is a point mass, max(0, p - q) = p: the replacement is what `sample` draws there."""
    logits = _rows([4, 0, 3, 0, 1, 0, 2, 0], [1, 0, 2, 0, 3, 0, 0, 0], [0, 1, 0, 1, 0, 1, 0, 1])
    first_accepted = 0
    for seed in range(30):
        params = SamplingParams(temperature=1.0, top_k=3, seed=seed)
        verdict = verify(logits, [0, 7], None, params, 40)  # token 0 is in row 0's top 3; token 7 is not in row 1's
        if verdict.num_accepted == 1:
            first_accepted += 1
            assert verdict.token_ids == [0, sample(logits[1:2], [params], [41])[0]]
        else:
            assert verdict.num_accepted == 0 and verdict.token_ids[0] != 0
    assert 10 <= first_accepted < 30  # p_0(0) = 0.67


def test_bonus_token_is_the_plain_draw_after_the_last_draft() -> None:
    """All drafts accepted: the bonus token is what non-speculative sampling draws from row k at its position."""
    logits = _rows([0, 9, 0, 0, 0, 0], [0, 0, 9, 0, 0, 0], [1, 0.5, 0, 2, 0, 1])
    all_accepted = 0
    for seed in range(30):
        params = SamplingParams(temperature=1.0, seed=seed)
        verdict = verify(logits, [1, 2], None, params, 100)
        if verdict.num_accepted == 2:  # p = 0.999 at both drafts
            all_accepted += 1
            assert verdict.token_ids == [1, 2, sample(logits[2:3], [params], [102])[0]]
    assert all_accepted >= 25


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=2.0, top_k=5, top_p=0.9),
    ],
)
def test_empty_draft_matches_non_speculative_sampling(params: SamplingParams) -> None:
    """k = 0: verify draws exactly the token `sample` draws for the same row, seed and position."""
    row = torch.tensor([[1.0, -0.5, 2.0, 0.3, 0.0, 1.7, -2.0, 0.9, 0.1, 1.1]])
    drawn = set()
    for seed in range(50):
        seeded = SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed)
        position = 3 * seed + 1
        verdict = verify(row, [], None, seeded, position)
        assert verdict == Verdict(sample(row, [seeded], [position]), 0)
        drawn.add(verdict.token_ids[0])
    assert len(drawn) > 1


def test_sequences_verified_one_after_another_give_what_they_give_alone() -> None:
    generator = torch.Generator().manual_seed(5)
    cases = []
    for i in range(8):
        k = i % 4
        logits = torch.randn(k + 1, 9, generator=generator) * 2
        drafts = torch.randint(0, 9, (k,), generator=generator).tolist()
        params = SamplingParams(temperature=0.5 + 0.25 * i, top_k=i % 5, top_p=1.0 - 0.05 * i, seed=100 + i)
        dists = [SparseDist(token_ids=[t, (t + 1) % 9], probs=[0.6, 0.4]) for t in drafts] if i % 2 else None
        cases.append((logits, drafts, dists, params, 10 * i))

    alone = [verify(*case) for case in reversed(cases)][::-1]
    together = [verify(*case) for case in cases]
    assert together == alone
    for (logits, drafts, _, params, _), verdict in zip(cases, together):
        assert len(verdict.token_ids) == verdict.num_accepted + 1
        assert verdict.token_ids[: verdict.num_accepted] == drafts[: verdict.num_accepted]
        assert float(target_probs(logits[verdict.num_accepted], params)[verdict.token_ids[-1]]) > 0


# ---------------------------------------------------------------- shapes


def test_wrong_number_of_logit_rows_raises() -> None:
    logits = torch.zeros(2, 6)
    for params in [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, seed=4)]:
        with pytest.raises(ValueError):
            verify(logits, [1, 2], None, params, 0)
        with pytest.raises(ValueError):
            verify(logits, [], None, params, 0)
        with pytest.raises(ValueError):
            verify(torch.zeros(4, 6), [1, 2], None, params, 0)


def test_wrong_number_of_draft_dists_raises() -> None:
    logits = torch.zeros(3, 6)
    dist = SparseDist(token_ids=[1], probs=[1.0])
    params = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError):
        verify(logits, [1, 1], [dist], params, 0)
    with pytest.raises(ValueError):
        verify(logits, [1, 1], [dist, dist, dist], params, 0)


# ---------------------------------------------------------------- the emitted tokens follow p


P_0 = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
P_1 = torch.tensor([0.1, 0.3, 0.05, 0.35, 0.2])
# Far from P_0: most of its mass on token 4 (p = 0.05), none on token 1 (p = 0.25).
Q_0 = SparseDist(token_ids=[0, 2, 4], probs=[0.2, 0.3, 0.5])
Q_1 = SparseDist(token_ids=[2, 0, 1], probs=[0.6, 0.3, 0.1])


def _dense(dist: SparseDist) -> torch.Tensor:
    q = torch.zeros(5)
    q[dist.token_ids] = torch.tensor(dist.probs)
    return q


def _drafts_from(dist: SparseDist, num_trials: int, seed: int) -> list[int]:
    return torch.multinomial(
        _dense(dist), num_trials, replacement=True, generator=torch.Generator().manual_seed(seed)
    ).tolist()


def test_first_token_follows_p_for_a_sampled_draft() -> None:
    """k = 1, x ~ q far from p: token_ids[0] (accepted x or the residual draw) is distributed as p."""
    num_trials = 30_000
    logits = torch.log(torch.stack([P_0, P_1]))
    drafts = _drafts_from(Q_0, num_trials, seed=1)
    counts = torch.zeros(5)
    accepted = 0
    for trial, draft in enumerate(drafts):
        verdict = verify(logits, [draft], [Q_0], SamplingParams(temperature=1.0, seed=trial), 17)
        counts[verdict.token_ids[0]] += 1
        accepted += verdict.num_accepted
    statistic, df = _chi_square(counts, P_0, num_trials)
    assert statistic < CHI_SQUARE_999[df]
    # The acceptance rate is sum_x min(p(x), q(x)) = 0.45.
    assert abs(accepted / num_trials - 0.45) < 0.02


def test_first_token_follows_p_for_a_masked_target() -> None:
    """Same with temperature and top-k: p has a zero cell where q puts mass, and it is never emitted."""
    num_trials = 20_000
    logits = torch.log(torch.stack([P_0, P_1]))
    dist = SparseDist(token_ids=[4, 3, 1], probs=[0.5, 0.3, 0.2])
    drafts = _drafts_from(dist, num_trials, seed=2)
    p = target_probs(logits[0], SamplingParams(temperature=0.8, top_k=4))
    assert p[4] == 0
    counts = torch.zeros(5)
    for trial, draft in enumerate(drafts):
        verdict = verify(logits, [draft], [dist], SamplingParams(temperature=0.8, top_k=4, seed=trial), 0)
        counts[verdict.token_ids[0]] += 1
    statistic, df = _chi_square(counts, p, num_trials)
    assert df == 3 and statistic < CHI_SQUARE_999[df]


def test_first_token_follows_p_for_a_fixed_draft_token() -> None:
    """A deterministic proposer (draft_dists=None) always proposing token 2: token_ids[0] is still distributed as p."""
    num_trials = 20_000
    logits = torch.log(torch.stack([P_0, P_1]))
    counts = torch.zeros(5)
    for trial in range(num_trials):
        counts[verify(logits, [2], None, SamplingParams(temperature=1.0, seed=trial), 5).token_ids[0]] += 1
    statistic, df = _chi_square(counts, P_0, num_trials)
    assert statistic < CHI_SQUARE_999[df]


def test_two_token_draft_follows_p_jointly() -> None:
    """k = 2 with x_0 ~ q_0, x_1 ~ q_1: the first two tokens of the sequence are distributed as p_0 x p_1.

    When x_0 is rejected the call emits one token; the second then comes from the next
    step, which is plain sampling of p_1 at the next position.
    """
    num_trials = 20_000
    logits = torch.log(torch.stack([P_0, P_1, P_0]))
    drafts_0 = _drafts_from(Q_0, num_trials, seed=3)
    drafts_1 = _drafts_from(Q_1, num_trials, seed=4)
    position = 30
    counts = torch.zeros(5, 5)
    for trial, (x_0, x_1) in enumerate(zip(drafts_0, drafts_1)):
        params = SamplingParams(temperature=1.0, seed=trial)
        tokens = verify(logits, [x_0, x_1], [Q_0, Q_1], params, position).token_ids
        if len(tokens) == 1:
            tokens = tokens + sample(logits[1:2], [params], [position + 1])
        counts[tokens[0], tokens[1]] += 1
    statistic, df = _chi_square(counts, torch.outer(P_0, P_1), num_trials)
    assert df == 24 and statistic < CHI_SQUARE_999[df]


# ---------------------------------------------------------------- reproducibility


def test_same_seed_same_verdict() -> None:
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))
    dists = [SparseDist(token_ids=[t, 9], probs=[0.7, 0.3]) for t in (3, 1, 7)]
    for seed in range(20):
        params = SamplingParams(temperature=1.2, top_p=0.95, seed=seed)
        assert verify(logits, [3, 1, 7], dists, params, 8) == verify(logits.clone(), [3, 1, 7], list(dists), params, 8)


def test_different_seeds_give_different_verdicts() -> None:
    logits = torch.zeros(3, 10)  # uniform p: each draft is accepted with probability 1/10
    verdicts = {
        (tuple(v.token_ids), v.num_accepted)
        for v in (verify(logits, [0, 0], None, SamplingParams(temperature=1.0, seed=seed), 0) for seed in range(8))
    }
    assert len(verdicts) > 4
    # The draw depends on the position too.
    positions = {
        verify(logits[:1], [], None, SamplingParams(temperature=1.0, seed=1), pos).token_ids[0] for pos in range(8)
    }
    assert len(positions) > 1
