"""Sampling as pure functions: greedy, top-k/top-p masks, reproducible seeded draws, and the drawn frequencies."""

from __future__ import annotations

import math

import pytest
import torch

from modeling.sampling.draw import draw, generator_for, is_greedy, sample, target_probs
from proto.messages import SamplingParams


def test_greedy_takes_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, -1.0, 4.9]])
    assert sample(logits, [SamplingParams(), SamplingParams()], [0, 0]) == [1, 0]


def test_top_k_keeps_k_best() -> None:
    probs = target_probs(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_k=2))
    assert probs[0] == 0 and probs[3] == 0
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-6)


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    best_only = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.1))
    torch.testing.assert_close(best_only, torch.tensor([1.0, 0.0, 0.0, 0.0]))


@pytest.mark.parametrize(("scale", "top_p"), [(8.0, 0.9), (3.0, 0.95), (0.3, 0.5), (0.05, 0.99)])
def test_top_p_over_a_large_vocabulary_keeps_what_a_whole_sort_keeps(scale: float, top_p: float) -> None:
    """Peaked and flat rows (a few kept tokens, or most of 5,000):
    only the likeliest are sorted, with the same result."""
    generator = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(3, 5000, generator=generator) * scale
    params = SamplingParams(temperature=0.8, top_p=top_p)
    ours = target_probs(logits, params)
    scaled = logits / 0.8
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    drop_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= top_p
    reference = torch.softmax(
        scaled.masked_fill(torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted), float("-inf")), dim=-1
    )
    assert torch.equal(ours > 0, reference > 0)
    torch.testing.assert_close(ours, reference)


def test_min_p_keeps_the_tokens_at_least_min_p_as_likely_as_the_best() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))  # keeps p >= 0.15
    assert torch.allclose(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    best_only = target_probs(logits, SamplingParams(temperature=1.0, min_p=1.0))
    assert best_only.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert torch.equal(
        target_probs(logits, SamplingParams(temperature=1.0, min_p=0.0)),
        target_probs(logits, SamplingParams(temperature=1.0)),
    )
    # After temperature and the other cuts: at temperature 2 the odds against the best are their square roots.
    warm = target_probs(logits, SamplingParams(temperature=2.0, min_p=0.5))  # sqrt(p / 0.5) >= 0.5: p >= 0.125
    assert (warm > 0).tolist() == [True, True, True, False]
    assert (target_probs(logits, SamplingParams(temperature=1.0, top_k=1, min_p=0.01)) > 0).tolist() == [
        True,
        False,
        False,
        False,
    ]


def test_seeded_draw_depends_only_on_seed_and_position() -> None:
    logits = torch.randn(3, 50)
    params = [SamplingParams(temperature=1.0, seed=7)] * 3
    first = sample(logits, params, [10, 11, 12])
    assert sample(logits, params, [10, 11, 12]) == first
    # The same row alone, at the same position, draws the same token.
    assert sample(logits[1:2], params[:1], [11]) == first[1:2]


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.5])
def test_draw_frequencies_follow_probs(temperature: float) -> None:
    probs = target_probs(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0]), SamplingParams(temperature=temperature))
    num_draws = 20_000
    counts = torch.zeros(5)
    for i in range(num_draws):
        counts[draw(probs, generator_for(1234, i, torch.device("cpu")))] += 1
    expected = probs * num_draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 18.47  # 4 degrees of freedom, p = 0.001


def test_a_temperature_too_small_to_divide_by_is_greedy_never_nan() -> None:
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    for temperature in (1e-30, 1e-38, 5e-6):
        params = SamplingParams(temperature=temperature, seed=3)
        assert is_greedy(params)
        assert sample(logits, [params], [0]) == [1]
    assert not is_greedy(SamplingParams(temperature=1e-4))
    assert not torch.isnan(target_probs(logits[0], SamplingParams(temperature=1e-4))).any()


def test_seeds_that_differ_only_above_32_bits_draw_differently() -> None:
    cpu = torch.device("cpu")
    for seed in (0, 12345, 2**40 + 7):
        first = torch.rand(4, generator=generator_for(seed, 9, cpu))
        assert not torch.equal(first, torch.rand(4, generator=generator_for(seed + 2**32, 9, cpu)))
        assert not torch.equal(first, torch.rand(4, generator=generator_for(seed + 2**33, 9, cpu)))
        assert torch.equal(first, torch.rand(4, generator=generator_for(seed, 9, cpu)))


@pytest.mark.parametrize("top_p", [1e-46, 1e-45, 1e-30, 1e-8])
def test_a_top_p_too_small_for_float32_keeps_the_best_token(top_p: float) -> None:
    """1e-46 is 0 in float32: the best token must still be kept (not every token masked, which drew token 0)."""
    logits = torch.tensor([0.0, 1.0, 5.0, 2.0, 4.9])
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=3))
    assert torch.isfinite(probs).all()
    assert probs.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert sample(logits[None], [SamplingParams(temperature=1.0, top_p=top_p, seed=3)], [7]) == [2]
