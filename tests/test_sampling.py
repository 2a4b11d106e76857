"""Sampling: greedy is argmax, a seed reproduces a run, and top-k / top-p never emit a token
outside the set they allow (property-based, over random logits). The batched sampler a serving
step uses gives each row exactly the reference's tokens, whatever shares its batch."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.sampling import (SamplingParams, sample, sample_rows, sample_with, top_k_filter,
                                top_p_filter)


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 4.0, 4.5]])
    assert sample(logits).tolist() == [1, 0]
    assert sample(logits, 0.0, top_k=1, top_p=0.1).tolist() == [1, 0]


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    logits = torch.zeros(4, 1000)  # uniform: every draw is pure randomness
    draw = lambda seed: sample(logits, 1.0, torch.Generator().manual_seed(seed)).tolist()  # noqa: E731
    assert draw(3) == draw(3)
    assert draw(3) != draw(4)


def test_low_temperature_concentrates_on_the_top_token() -> None:
    logits = torch.tensor([[1.0, 2.0, 0.5]]).expand(2000, 3)
    g = torch.Generator().manual_seed(0)
    cold = sample(logits, 0.05, g)
    assert (cold == 1).all()


@pytest.mark.parametrize("kwargs, fragment", [
    ({"temperature": -1}, "temperature must be >= 0"),
    ({"top_k": 0}, "top_k must be at least 1"),
    ({"top_p": 0.0}, "top_p must be in \\(0, 1\\]"),
    ({"top_p": 1.5}, "top_p must be in \\(0, 1\\]"),
])
def test_invalid_parameters_name_the_limit(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=fragment):
        sample(torch.zeros(1, 3), **{"temperature": 1.0, **kwargs})


def test_top_p_keeps_the_smallest_nucleus() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.9) == [True, True, True, False]
    assert kept(1.0) == [True, True, True, True]


def test_top_k_keeps_ties_at_the_cut() -> None:
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0]])
    assert torch.isfinite(top_k_filter(logits, 2))[0].tolist() == [True, True, True, False]


def _allowed_top_k(logits: torch.Tensor, k: int) -> set[int]:
    kth = sorted(logits.tolist(), reverse=True)[min(k, len(logits)) - 1]
    return {i for i, x in enumerate(logits.tolist()) if x >= kth}


def _allowed_top_p(logits: torch.Tensor, p: float) -> set[int]:
    # Independent definition: token i is allowed when the mass of the tokens strictly more
    # likely than it is below p. Probabilities in float32 as the sampler sees them (two
    # logits closer than float32 resolution are a tie there), summed with a hair of slack.
    probs = torch.softmax(logits.float(), -1).tolist()
    return {i for i, q in enumerate(probs)
            if sum(x for x in probs if x > q) < p + 1e-5}


logit_rows = st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=2, max_size=40)


@settings(max_examples=150, deadline=None)
@given(row=logit_rows, k=st.integers(1, 45), seed=st.integers(0, 2**31 - 1),
       temperature=st.sampled_from([0.3, 1.0, 2.5]))
def test_top_k_never_emits_a_token_outside_the_top_k(row: list[float], k: int, seed: int,
                                                     temperature: float) -> None:
    logits = torch.tensor([row] * 64)
    tokens = sample(logits, temperature, torch.Generator().manual_seed(seed), top_k=k)
    assert set(tokens.tolist()) <= _allowed_top_k(logits[0], k)


@settings(max_examples=150, deadline=None)
@given(row=logit_rows, p=st.floats(0.01, 1.0), seed=st.integers(0, 2**31 - 1),
       temperature=st.sampled_from([0.3, 1.0, 2.5]))
def test_top_p_never_emits_a_token_outside_the_nucleus(row: list[float], p: float, seed: int,
                                                       temperature: float) -> None:
    logits = torch.tensor([row] * 64)
    tokens = sample(logits, temperature, torch.Generator().manual_seed(seed), top_p=p)
    assert set(tokens.tolist()) <= _allowed_top_p(logits[0] / temperature, p)


@settings(max_examples=100, deadline=None)
@given(row=logit_rows, k=st.integers(1, 45), p=st.floats(0.01, 1.0), seed=st.integers(0, 2**31 - 1))
def test_top_k_and_top_p_together_stay_inside_both_sets(row: list[float], k: int, p: float,
                                                       seed: int) -> None:
    logits = torch.tensor([row] * 64)
    tokens = set(sample(logits, 1.0, torch.Generator().manual_seed(seed), top_k=k, top_p=p).tolist())
    assert tokens <= _allowed_top_k(logits[0], k)


MIXED = [SamplingParams(), SamplingParams(temperature=0.8, top_k=5, seed=1),
         SamplingParams(temperature=1.3, top_p=0.7, seed=2), SamplingParams(temperature=0.5),
         SamplingParams(temperature=1.0, top_k=12, top_p=0.9, seed=3),
         SamplingParams(temperature=2.0, top_k=1000, top_p=1.0, seed=4)]


def test_batched_rows_draw_exactly_what_each_row_draws_alone() -> None:
    """``sample_rows`` (one batch, per-row parameters and generators) against ``sample_with``
    row by row, over ten consecutive draws (the generators' streams stay in step); unseeded
    rows share the default generator, so they are compared under one global seed."""
    logits = torch.randn(len(MIXED), 50, generator=torch.Generator().manual_seed(0)) * 3
    gens = [p.generator() for p in MIXED]
    ref_gens = [p.generator() for p in MIXED]
    with torch.random.fork_rng():
        torch.manual_seed(7)
        batched = [sample_rows(logits, MIXED, gens).tolist() for _ in range(10)]
        torch.manual_seed(7)
        alone = [[int(sample_with(logits[r:r + 1], p, g)) for r, (p, g) in
                  enumerate(zip(MIXED, ref_gens))] for _ in range(10)]
    assert batched == alone
    assert sample_rows(logits, [SamplingParams()] * len(MIXED), [None] * len(MIXED)).tolist() \
        == logits.argmax(-1).tolist()


def test_a_rows_tokens_do_not_depend_on_its_batch() -> None:
    logits = torch.randn(len(MIXED), 50, generator=torch.Generator().manual_seed(1)) * 3
    seeded = [i for i, p in enumerate(MIXED) if p.seed is not None]
    whole = sample_rows(logits, MIXED, [p.generator() for p in MIXED])
    for i in seeded:
        alone = sample_rows(logits[i:i + 1], [MIXED[i]], [MIXED[i].generator()])
        assert int(alone) == int(whole[i])


def test_batched_draws_follow_the_softmax() -> None:
    """2,000 rows of one distribution from one seeded stream: each token's frequency within
    0.03 of its probability (about 3 standard deviations at p = 0.5), cut tokens never drawn."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 2000
    g = torch.Generator().manual_seed(11)
    for params, probs in [
            (SamplingParams(temperature=1.0), torch.softmax(logits, -1)),
            (SamplingParams(temperature=0.5, top_k=3), torch.softmax(logits[:3] / 0.5, -1))]:
        tokens = sample_rows(logits.expand(n, 6), [params] * n, [g] * n)
        freq = torch.bincount(tokens, minlength=6).float() / n
        assert torch.allclose(freq[:len(probs)], probs, atol=0.03), (freq, probs)
        assert freq[len(probs):].sum() == 0


@settings(max_examples=100, deadline=None)
@given(row=logit_rows, k=st.one_of(st.none(), st.integers(1, 45)),
       p=st.one_of(st.none(), st.floats(0.01, 1.0)), seed=st.integers(0, 2**31 - 1),
       temperature=st.sampled_from([0.3, 1.0, 2.5]))
def test_batched_rows_equal_the_reference_for_any_settings(row: list[float], k: int | None,
                                                           p: float | None, seed: int,
                                                           temperature: float) -> None:
    """Next to a greedy row and a row with other settings, so per-row settings are exercised;
    the reference's top-k / top-p properties then carry over."""
    logits = torch.tensor([row] * 3)
    params = [SamplingParams(temperature, k, p, seed), SamplingParams(),
              SamplingParams(1.0, top_k=2, top_p=0.5, seed=seed + 1)]
    got = sample_rows(logits, params, [sp.generator() for sp in params]).tolist()
    want = [int(sample_with(logits[i:i + 1], sp, sp.generator())) for i, sp in enumerate(params)]
    assert got == want
