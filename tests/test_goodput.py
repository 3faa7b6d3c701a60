"""Goodput math (expected tokens, step time, best_plan at one row) and the measured CostTable."""

from __future__ import annotations

import math

import pytest
from conftest import slow_except

from hf_adaspec.costs.table import CostTable
from hf_adaspec.policy.goodput import (
    DrafterPaths,
    Plan,
    best_goodput,
    best_plan,
    break_even_alpha,
    expected_tokens,
    expected_tokens_prefix,
    goodput,
    horizon_goodput,
    step_time_ms,
)

ALPHAS = [0.0, 0.1, 0.37, 0.5, 0.8, 0.99]
FLAT = CostTable(verify_ms=(10.0,) * 9, draft_ms=0.0)  # verification costs 10 ms for 1..9 tokens


def _brute_force(alpha: float, k: int) -> float:
    """E[tokens] = Σ_{m=1..k+1} m·P(m): accepted n ~ truncated geometric, emitted m = n + 1."""
    total = 0.0
    for n in range(k + 1):
        prob = alpha**n * (1 - alpha) if n < k else alpha**k  # stop at first rejection, or all k accepted
        total += (n + 1) * prob
    return total


def _iid(alpha: float, upper: int, draft_ms: float = 0.0, setup_ms: float = 0.0) -> DrafterPaths:
    """One drafter's path for one row of up to ``upper`` tokens at i.i.d. acceptance α: P_j = α^j."""
    return DrafterPaths((tuple(alpha**j for j in range(1, upper + 1)),), draft_ms, setup_ms)


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


def test_expected_tokens_prefix_generalises_leviathan_eq1():
    assert expected_tokens_prefix([]) == 1.0
    assert expected_tokens_prefix([0.8, 0.5, 0.2]) == pytest.approx(2.5)
    alpha = 0.7  # i.i.d. acceptance: P(prefix j) = α^j gives Eq. 1's closed form
    assert expected_tokens_prefix([alpha**j for j in (1, 2, 3)]) == pytest.approx(expected_tokens(alpha, 3))
    with pytest.raises(ValueError):
        expected_tokens_prefix([1.5])


def test_step_time_and_goodput_formula():
    costs = CostTable(verify_ms=(10.0, 12.0, 14.0), draft_ms=2.0)
    assert step_time_ms(2, 2.0, costs.t_verify) == 18.0 and step_time_ms(0, 2.0, costs.t_verify) == 10.0
    # k=2: E = 1 + .5 + .25 = 1.75 tokens over 2·2 + t_verify(3)=14 → 18 ms
    assert goodput(0.5, 2, 2.0, costs.t_verify) == pytest.approx(1000 * 1.75 / 18)
    assert goodput(0.5, 0, 2.0, costs.t_verify) == pytest.approx(100.0)  # one plain 10 ms forward


def test_horizon_goodput():
    assert horizon_goodput(100.0, 0.0, 10) == 100.0
    assert horizon_goodput(100.0, 100.0, 10) == pytest.approx(10 / (0.1 + 0.1))  # 50 tokens/s


# --- best_plan at one row ---------------------------------------------------------------------


def test_best_plan_flat_verify_free_draft_high_alpha_takes_the_whole_path():
    for upper in (1, 4, 8):
        plan = best_plan([_iid(0.9, upper)], FLAT.t_verify)
        assert (plan.k, plan.drafters) == (upper, (0,))
        assert plan.goodput == pytest.approx(goodput(0.9, upper, 0.0, FLAT.t_verify))


def test_best_plan_expensive_draft_low_alpha_is_plain():
    assert best_plan([_iid(0.2, 8, draft_ms=10.0)], FLAT.t_verify) == Plan(0, (0,), pytest.approx(100.0), 10.0)
    # drafting at t_verify can never win (k+1 forwards' time for ≤ k+1 tokens); at half of it, α=0.99 does
    assert best_plan([_iid(0.99, 8, draft_ms=10.0)], FLAT.t_verify).k == 0
    assert best_plan([_iid(0.99, 8, draft_ms=5.0)], FLAT.t_verify).k > 0


def test_best_plan_nothing_to_draft_is_plain():
    assert best_plan([_iid(0.9, 0)], FLAT.t_verify).k == 0


def test_best_plan_interior_optimum():
    plan = best_plan([_iid(0.6, 8, draft_ms=1.0)], FLAT.t_verify)
    rates = [goodput(0.6, k, 1.0, FLAT.t_verify) for k in range(9)]
    assert plan.k == max(range(9), key=lambda k: rates[k]) and 0 < plan.k < 8
    assert plan.goodput == pytest.approx(max(rates))
    assert plan.tpot_ms == pytest.approx(1000.0 / max(rates))  # one row: TPOT = 1 / goodput


def test_best_plan_prices_a_calibrated_path_not_only_iid():
    costs = CostTable(verify_ms=(10.0, 12.0, 14.0), draft_ms=2.0)
    # k=1: 1.8 tokens / 14 ms = 128.6/s beats k=2: 2.3 tokens / 18 ms = 127.8/s and plain: 100/s
    plan = best_plan([DrafterPaths(((0.8, 0.5),), draft_ms=2.0)], costs.t_verify)
    assert plan.k == 1
    assert plan.goodput == pytest.approx(1000 * 1.8 / 14) and plan.tpot_ms == pytest.approx(14 / 1.8)


def test_best_plan_ties_keep_the_smaller_k():
    # α = 0: every k yields 1 token; flat verification + free drafting → all goodputs equal plain's
    assert best_plan([_iid(0.0, 8)], FLAT.t_verify).k == 0
    # exact tie between k=1 and k=2: 1.5 tokens / 6 ms == 1.75 tokens / 7 ms == 250 tokens/s
    verify = {1: 10.0, 2: 6.0, 3: 7.0}
    assert goodput(0.5, 1, 0.0, verify.__getitem__) == goodput(0.5, 2, 0.0, verify.__getitem__) == 250.0
    plan = best_plan([_iid(0.5, 2)], verify.__getitem__)
    assert (plan.k, plan.goodput) == (1, 250.0)


def test_best_plan_min_gain_margin_favours_plain():
    free = best_plan([_iid(0.5, 8, draft_ms=4.0)], FLAT.t_verify)
    assert free.k > 0
    gain = free.goodput / 100.0 - 1.0  # relative gain over a plain 10 ms step
    assert best_plan([_iid(0.5, 8, draft_ms=4.0)], FLAT.t_verify, min_gain=gain + 0.01).k == 0
    assert best_plan([_iid(0.5, 8, draft_ms=4.0)], FLAT.t_verify, min_gain=gain - 0.01).k == free.k


def test_best_plan_amortises_the_catchup_over_the_horizon():
    # k=1 at α=0.5: 136 tokens/s steady, but a 100 ms catch-up over 10 tokens drops it below plain
    assert best_plan([_iid(0.5, 1, draft_ms=1.0, setup_ms=100.0)], FLAT.t_verify, horizon=10).k == 0
    assert best_plan([_iid(0.5, 1, draft_ms=1.0, setup_ms=100.0)], FLAT.t_verify, horizon=1000).k == 1
    # a one-off 1 s catch-up amortised over 3 tokens never pays
    assert best_plan([_iid(0.5, 8, draft_ms=4.0, setup_ms=1000.0)], FLAT.t_verify, horizon=3).k == 0


def test_a_catchup_one_token_cannot_pay_is_paid_by_the_whole_run():
    """A 60 ms catch-up over a 12-token horizon: one draft token at α = 0.9 does not pay it, six do."""
    one = best_plan([_iid(0.9, 1, draft_ms=1.0, setup_ms=60.0)], FLAT.t_verify, horizon=12)
    six = best_plan([_iid(0.9, 6, draft_ms=1.0, setup_ms=60.0)], FLAT.t_verify, horizon=12)
    assert one.k == 0 and six.k == 6
    steady = 1000.0 * expected_tokens(0.9, 6) / 16.0
    assert six.goodput == pytest.approx(horizon_goodput(steady, 60.0, 12))
    assert six.tpot_ms == pytest.approx(1000.0 / steady)  # TPOT is the steady state, catch-up excluded


@pytest.mark.parametrize("seed", slow_except(range(4), fast={0}))  # make test runs every seed
def test_best_plan_skips_only_plans_that_cannot_beat_plain(seed):
    """Without an SLO best_plan leaves out plans whose whole paths accepted would not beat a plain step;
    an SLO nothing breaks (inf) assembles every plan: the same plan either way, on random batches, paths,
    margins and verification tables that are not monotone."""
    import random

    rng = random.Random(seed)
    for _ in range(300):
        rows, drafters = rng.randint(1, 4), rng.randint(1, 3)
        priced = []
        for d in range(drafters):
            paid = d == 0 and rng.random() < 0.7
            paths = []
            for _ in range(rows):
                c, path = rng.random(), []
                for _ in range(rng.randint(0, 8)):
                    path.append((path[-1] if path else 1.0) * c * rng.uniform(0.7, 1.0))
                paths.append(tuple(path))
            priced.append(
                DrafterPaths(
                    tuple(paths),
                    rng.uniform(0.1, 8.0) if paid else 0.0,
                    rng.choice([0.0, rng.uniform(0.0, 80.0)]) if paid else 0.0,
                )
            )
        verify = [rng.uniform(5.0, 15.0) for _ in range(9)]
        args = (lambda n, verify=verify: verify[min(n, 9) - 1], rng.randint(1, 200), rng.choice([0.0, 0.03, 0.2]))
        assert best_plan(priced, *args) == best_plan(priced, *args, tpot_slo_ms=math.inf)


# --- the measured cost table ------------------------------------------------------------------


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


def test_break_even_alpha_is_where_the_cheaper_drafter_catches_up():
    verify = lambda n: 80.0 + 5.0 * (n - 1)  # noqa: E731
    rival = best_goodput(0.8, 30.0, verify)
    alpha = break_even_alpha(5.0, verify, rival)
    assert 0.0 < alpha < 0.8  # a drafter 6x cheaper needs less agreement
    assert best_goodput(alpha, 5.0, verify) == pytest.approx(rival, rel=1e-6)
    assert best_goodput(alpha - 0.01, 5.0, verify) < rival
    assert break_even_alpha(30.0, verify, rival) == pytest.approx(0.8, abs=1e-6)  # the same drafter: its own α
    assert break_even_alpha(5.0, verify, 1000.0 / verify(1) * 100) == 1.0  # 100x plain: out of reach
