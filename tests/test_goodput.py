"""Goodput math (expected tokens, best k) and the measured CostTable."""

from __future__ import annotations

import math

import pytest

from hf_adaspec.costs import CostTable
from hf_adaspec.goodput import KChoice, best_k, expected_tokens, goodput, horizon_goodput

ALPHAS = [0.0, 0.1, 0.37, 0.5, 0.8, 0.99]


def _brute_force(alpha: float, k: int) -> float:
    """E[tokens] = Σ_{m=1..k+1} m·P(m): accepted n ~ truncated geometric, emitted m = n + 1."""
    total = 0.0
    for n in range(k + 1):
        prob = alpha**n * (1 - alpha) if n < k else alpha**k  # stop at first rejection, or all k accepted
        total += (n + 1) * prob
    return total


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("k", [0, 1, 2, 5, 8])
def test_expected_tokens_matches_closed_form_and_brute_force(alpha, k):
    e = expected_tokens(alpha, k)
    assert e == pytest.approx(sum(alpha**i for i in range(k + 1)), rel=1e-12)
    assert e == pytest.approx(_brute_force(alpha, k), rel=1e-12)


@pytest.mark.parametrize("alpha", ALPHAS + [1.0])
def test_expected_tokens_k0_is_one_plain_step(alpha):
    assert expected_tokens(alpha, 0) == pytest.approx(1.0)


@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_expected_tokens_alpha_one_accepts_everything(k):
    assert expected_tokens(1.0, k) == k + 1


def test_expected_tokens_monotone_in_alpha_and_k():
    assert expected_tokens(0.3, 4) < expected_tokens(0.6, 4) < expected_tokens(0.9, 4)
    assert expected_tokens(0.6, 1) < expected_tokens(0.6, 2) < expected_tokens(0.6, 8) < 1 / (1 - 0.6)


@pytest.mark.parametrize("alpha, k", [(-0.01, 2), (1.01, 2), (math.nan, 2), (0.5, -1)])
def test_expected_tokens_rejects_bad_inputs(alpha, k):
    with pytest.raises(ValueError):
        expected_tokens(alpha, k)


def test_goodput_formula():
    costs = CostTable(verify_ms=(10.0, 12.0, 14.0), draft_ms=2.0)
    # k=2: E = 1 + .5 + .25 = 1.75 tokens over 2·2 + t_verify(3)=14 → 18 ms
    assert goodput(0.5, 2, 2.0, costs.t_verify) == pytest.approx(1000 * 1.75 / 18)
    assert goodput(0.5, 0, 2.0, costs.t_verify) == pytest.approx(100.0)  # one plain 10 ms forward


def test_best_k_flat_verify_free_draft_high_alpha_is_k_max():
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=0.0)
    for k_max in (1, 4, 8):
        choice = best_k(0.9, k_max, costs.draft_ms, costs.t_verify)
        assert choice.k == k_max
        assert choice.goodput == pytest.approx(goodput(0.9, k_max, 0.0, costs.t_verify))


def test_best_k_expensive_draft_low_alpha_is_plain():
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=10.0)
    choice = best_k(0.2, 8, costs.draft_ms, costs.t_verify)
    assert choice == KChoice(k=0, goodput=pytest.approx(100.0))
    # drafting at t_verify can never win (k+1 forwards' time for ≤ k+1 tokens); at half of it, α=0.99 does
    assert best_k(0.99, 8, costs.draft_ms, costs.t_verify).k == 0
    assert best_k(0.99, 8, 5.0, costs.t_verify).k > 0


def test_best_k_interior_optimum():
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
    choice = best_k(0.6, 8, costs.draft_ms, costs.t_verify)
    rates = [goodput(0.6, k, 1.0, costs.t_verify) for k in range(9)]
    assert choice.k == max(range(9), key=lambda k: rates[k]) and 0 < choice.k < 8
    assert isinstance(choice, KChoice) and isinstance(choice.k, int)
    assert choice.goodput == pytest.approx(max(rates))


def test_best_k_ties_pick_smaller_k():
    # α = 0: every k yields 1 token; flat verification + free drafting → all goodputs equal
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=0.0)
    assert best_k(0.0, 8, 0.0, costs.t_verify).k == 0
    # exact tie between k=1 and k=2: 1.5 tokens / 6 ms == 1.75 tokens / 7 ms == 250 tokens/s
    verify = {1: 10.0, 2: 6.0, 3: 7.0}
    assert goodput(0.5, 1, 0.0, verify.__getitem__) == goodput(0.5, 2, 0.0, verify.__getitem__) == 250.0
    assert best_k(0.5, 2, 0.0, verify.__getitem__) == KChoice(k=1, goodput=250.0)


def test_best_k_min_gain_and_setup_cost_favour_plain():
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=4.0)
    free = best_k(0.5, 8, costs.draft_ms, costs.t_verify)
    assert free.k > 0
    gain = free.goodput / goodput(0.5, 0, 4.0, costs.t_verify) - 1.0  # relative gain over plain
    assert best_k(0.5, 8, 4.0, costs.t_verify, min_gain=gain + 0.01).k == 0
    assert best_k(0.5, 8, 4.0, costs.t_verify, min_gain=gain - 0.01).k == free.k
    # a one-off 1 s draft catch-up amortised over 3 tokens never pays
    assert best_k(0.5, 8, 4.0, costs.t_verify, setup_ms=1000.0, horizon=3).k == 0


def test_horizon_goodput():
    assert horizon_goodput(100.0, 0.0, 10) == 100.0
    assert horizon_goodput(100.0, 100.0, 10) == pytest.approx(10 / (0.1 + 0.1))  # 50 tokens/s


def test_cost_table_t_verify_indexing_and_extrapolation():
    costs = CostTable(verify_ms=(10.0, 12.0, 14.0), draft_ms=1.0)
    assert [costs.t_verify(n) for n in (1, 2, 3)] == [10.0, 12.0, 14.0]
    assert costs.max_tokens == 3
    assert costs.t_verify(5) == pytest.approx(18.0)  # slope (14 − 10) / 2 = 2 ms per token
    assert CostTable(verify_ms=(10.0, 8.0), draft_ms=0.0).t_verify(4) == 8.0  # never extrapolate downwards
    assert CostTable(verify_ms=(7.0,), draft_ms=0.0).t_verify(3) == 7.0
    with pytest.raises(ValueError):
        costs.t_verify(0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"verify_ms": (), "draft_ms": 1.0},
        {"verify_ms": (10.0, -1.0), "draft_ms": 1.0},
        {"verify_ms": (10.0, 0.0), "draft_ms": 1.0},
        {"verify_ms": (10.0,), "draft_ms": -0.5},
        {"verify_ms": (10.0,), "draft_ms": 1.0, "draft_catchup_ms": -1.0},
    ],
)
def test_cost_table_validation(kwargs):
    with pytest.raises(ValueError):
        CostTable(**kwargs)
