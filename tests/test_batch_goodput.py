"""best_plan over a batch (one k for all rows, a drafter per row, free and paid drafters), the batch
stop rule draft_next_column, and the ragged KV cache (holes must not change any row)."""

from __future__ import annotations

import pytest
import torch

from hf_adaspec.backend import hf_compat
from hf_adaspec.backend.ragged import RaggedCache, left_pad, right_pad
from hf_adaspec.costs.table import CostTable
from hf_adaspec.policy.goodput import DrafterPaths, best_plan, draft_next_column, goodput


def _linear_costs(batch: int, n_max: int = 9) -> CostTable:
    """A CPU-like table: every verified position of every row costs 10 ms on top of 50 ms."""
    return CostTable(verify_ms=tuple(50.0 + 10.0 * batch * n for n in range(1, n_max + 1)), draft_ms=5.0 * batch)


def _path(alpha: float, upper: int) -> tuple[float, ...]:
    return tuple(alpha**j for j in range(1, upper + 1))


def _paths(alphas, uppers, draft_ms=0.0, setup_ms=0.0) -> DrafterPaths:
    """One drafter's paths for each row: i.i.d. α_i up to u_i tokens."""
    return DrafterPaths(tuple(_path(a, u) for a, u in zip(alphas, uppers, strict=True)), draft_ms, setup_ms)


def _batch_rate(alphas, uppers, k, draft_ms, t_verify) -> float:
    """SmartSpec §4.2 by hand: Σ_i E(α_i, min(k, u_i)) over k·t_draft + t_verify(k+1), tokens/s."""
    tokens = sum((1 - a ** (min(k, u) + 1)) / (1 - a) for a, u in zip(alphas, uppers, strict=True))
    return 1000.0 * tokens / (k * draft_ms + t_verify(k + 1))


def test_one_row_plan_is_the_single_request_argmax():
    costs = _linear_costs(1)
    plan = best_plan([_paths([0.7], [8], costs.draft_ms)], costs.t_verify)
    rates = [goodput(0.7, k, costs.draft_ms, costs.t_verify) for k in range(9)]
    assert plan.k == max(range(9), key=rates.__getitem__) > 0
    assert plan.goodput == pytest.approx(max(rates))


def test_each_row_counts_up_to_its_own_upper_bound():
    flat = CostTable(verify_ms=(50.0,) * 9, draft_ms=5.0)
    both = best_plan([_paths([0.8, 0.8], [4, 4], 5.0)], flat.t_verify)
    capped = best_plan([_paths([0.8, 0.8], [4, 0], 5.0)], flat.t_verify)  # row 2 has nothing to draft: E = 1
    assert capped.k == both.k == 4
    assert capped.goodput == pytest.approx(_batch_rate([0.8, 0.8], [4, 0], 4, 5.0, flat.t_verify))
    assert capped.goodput < both.goodput
    assert capped.tpot_ms == pytest.approx(2 * 1000.0 / capped.goodput)  # ms per token per row


def test_k_shrinks_as_verification_gets_costlier_down_to_plain():
    ks = [
        best_plan([_paths([0.8] * b, [8] * b, _linear_costs(b).draft_ms)], _linear_costs(b).t_verify).k
        for b in (1, 2, 4, 8, 16)
    ]
    assert ks == sorted(ks, reverse=True) and ks[0] >= 2 and ks[-1] == 0


def test_one_drafter_plan_matches_the_batch_formula():
    costs = _linear_costs(2)
    plan = best_plan([_paths([0.8, 0.6], [8, 3], costs.draft_ms)], costs.t_verify)
    assert plan.k > 0 and plan.drafters == (0, 0)
    assert plan.goodput == pytest.approx(_batch_rate([0.8, 0.6], [8, 3], plan.k, costs.draft_ms, costs.t_verify))


def test_plain_when_acceptance_is_low_and_the_margin_applies():
    assert best_plan([_paths([0.05, 0.05], [8, 8], 10.0)], _linear_costs(2).t_verify).k == 0
    free = CostTable(verify_ms=(100.0, 101.0), draft_ms=0.0)  # k = 1 gains ~1% with α = 0.02
    assert best_plan([_paths([0.02], [1])], free.t_verify).k == 1
    assert best_plan([_paths([0.02], [1])], free.t_verify, min_gain=0.03).k == 0


def test_free_and_paid_drafters_per_row():
    """Drafter 0 = draft model (costs a forward), 1 = prompt lookup (free, only where an n-gram matched)."""
    costs = CostTable(verify_ms=tuple(60.0 + 5.0 * n for n in range(1, 10)), draft_ms=5.0)
    lookup = _paths([0.95, 0.5], [6, 0])
    # row 0 has a good n-gram continuation, row 1 none: lookup for row 0; the draft model pays for row 1
    plan = best_plan([_paths([0.7, 0.9], [8, 8], 5.0), lookup], costs.t_verify)
    assert plan.k > 0 and plan.drafters == (1, 0)
    # the draft model barely accepts: its forward is not paid; lookup alone for the row that has one
    plan = best_plan([_paths([0.1, 0.1], [8, 8], 5.0), lookup], costs.t_verify)
    assert plan.k > 0 and plan.drafters[0] == 1
    tokens = (1 - 0.95 ** (plan.k + 1)) / 0.05 + 1.0
    assert plan.goodput == pytest.approx(1000.0 * tokens / costs.t_verify(plan.k + 1))  # no draft time


def test_a_paid_drafters_catchup_is_amortised_over_every_rows_horizon():
    flat = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
    paid = _paths([0.9, 0.9], [4, 4], 1.0, setup_ms=200.0)
    assert best_plan([paid], flat.t_verify, horizon=5).k == 0  # 200 ms over 2 × 5 tokens
    assert best_plan([paid], flat.t_verify, horizon=500).k == 4
    # a free drafter with a catch-up-priced paid one: the free one is taken without the catch-up
    plan = best_plan([paid, _paths([0.9, 0.9], [4, 4])], flat.t_verify, horizon=5)
    assert plan.k == 4 and plan.drafters == (1, 1)


def test_equal_drafters_tie_to_the_smaller_index():
    plan = best_plan([_paths([0.8, 0.8], [4, 4]), _paths([0.8, 0.8], [4, 4])], CostTable((10.0,) * 9, 0.0).t_verify)
    assert plan.k == 4 and plan.drafters == (0, 0)


# --- draft_next_column over a batch -----------------------------------------------------------


def test_batch_stop_rule_weighs_every_growing_row():
    flat = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
    # two rows at j = 1 with P_1 = 0.9: 3.8 tokens in 11 ms; a column more pays iff Σ p > 3.8/11
    threshold = 3.8 / 11
    assert draft_next_column([[0.9], [0.9]], [threshold / 2 + 1e-6] * 2, 1.0, flat.t_verify)
    assert not draft_next_column([[0.9], [0.9]], [threshold / 2 - 1e-6] * 2, 1.0, flat.t_verify)
    assert draft_next_column([[0.9], [0.9]], [threshold + 1e-6, 0.0], 1.0, flat.t_verify)  # one row carries it
    assert not draft_next_column([[0.9], [0.9]], [0.0, 0.0], 1.0, flat.t_verify)  # no row grows
    # rows of different widths: j = the widest row's, each row counts its own drafted prefix
    assert draft_next_column([[0.9, 0.8], [0.9]], [0.5, 0.0], 1.0, flat.t_verify)
    assert not draft_next_column([[0.9, 0.8], [0.9]], [0.1, 0.0], 1.0, flat.t_verify)


# --- the ragged KV cache ----------------------------------------------------------------------


def _alone(model, tokens: list[int]) -> torch.Tensor:
    """Last-position logits [V] of one unpadded row."""
    return hf_compat.forward_logits(model, torch.tensor([tokens]), hf_compat.new_cache(model), keep=1)[0, -1]


@torch.no_grad()
def test_ragged_cache_rows_compute_what_they_would_alone(tiny_factory, one_thread):
    model = tiny_factory(0)
    rows = [list(range(5, 15)), [20, 21, 22, 23]]
    cache = RaggedCache(model, 2)
    logits = cache.append(*left_pad([torch.tensor(r) for r in rows], 0), keep=1)[:, -1]  # prompts, left-padded
    for i, r in enumerate(rows):
        torch.testing.assert_close(logits[i], _alone(model, r), atol=1e-5, rtol=1e-5)
    cache.append(*right_pad([torch.tensor([30, 31, 32]), torch.tensor([40])], 0), keep=3)  # ragged block
    cache.rollback(torch.tensor([12, 5]))  # row 0 keeps 30, 31 (32 rejected); row 1 keeps 40
    assert cache.lengths.tolist() == [12, 5] and cache.mask.shape[1] == 12  # the unused column is cropped
    logits = cache.append(*left_pad([torch.tensor([50]), torch.tensor([51, 52])], 0), keep=1)[:, -1]
    full = [rows[0] + [30, 31, 50], rows[1] + [40, 51, 52]]
    for i, r in enumerate(full):
        torch.testing.assert_close(logits[i], _alone(model, r), atol=1e-5, rtol=1e-5)
    cache.select(torch.tensor([1]))  # row 0 finished
    logits = cache.append(torch.tensor([[7]]), torch.tensor([[True]]), keep=1)[:, -1]
    torch.testing.assert_close(logits[0], _alone(model, full[1] + [7]), atol=1e-5, rtol=1e-5)
