"""Batch goodput math, the batch controller, and the ragged KV cache (holes must not change any row)."""

from __future__ import annotations

import pytest
import torch

from hf_adaspec import hf_compat
from hf_adaspec.batch_controller import BatchFixedController, BatchGoodputController
from hf_adaspec.costs import CostTable
from hf_adaspec.goodput import batch_goodput, best_batch_plan, goodput
from hf_adaspec.ragged import RaggedCache, left_pad, right_pad


def _linear_costs(batch: int, n_max: int = 9) -> CostTable:
    """A CPU-like table: every verified position of every row costs 10 ms on top of 50 ms."""
    return CostTable(verify_ms=tuple(50.0 + 10.0 * batch * n for n in range(1, n_max + 1)), draft_ms=5.0 * batch)


def test_batch_goodput_of_one_row_is_goodput():
    costs = _linear_costs(1)
    for k in range(5):
        assert batch_goodput([0.7], [8], k, 5.0, costs.t_verify) == pytest.approx(goodput(0.7, k, 5.0, costs.t_verify))


def test_batch_goodput_counts_each_row_up_to_its_own_upper_bound():
    costs = _linear_costs(2)
    both = batch_goodput([0.8, 0.8], [4, 4], 4, 10.0, costs.t_verify)
    capped = batch_goodput([0.8, 0.8], [4, 0], 4, 10.0, costs.t_verify)  # row 2 has nothing to draft: E = 1
    step = 4 * 10.0 + costs.t_verify(5)
    assert capped == pytest.approx(1000.0 * ((1 - 0.8**5) / 0.2 + 1.0) / step)
    assert capped < both


def _single(alphas, uppers, costs, **kwargs):
    """best_batch_plan with one drafter (the draft model)."""
    return best_batch_plan([alphas], [uppers], [costs.draft_ms], costs.t_verify, **kwargs)


def test_best_batch_plan_k_shrinks_with_batch_size_to_plain():
    ks = [_single([0.8] * b, [8] * b, _linear_costs(b)).k for b in (1, 2, 4, 8, 16)]
    assert ks == sorted(ks, reverse=True) and ks[0] >= 2 and ks[-1] == 0


def test_best_batch_plan_matches_batch_goodput_for_one_drafter():
    costs = _linear_costs(2)
    plan = _single([0.8, 0.6], [8, 3], costs)
    assert plan.k > 0 and plan.drafters == (0, 0)
    assert plan.goodput == pytest.approx(batch_goodput([0.8, 0.6], [8, 3], plan.k, costs.draft_ms, costs.t_verify))


def test_best_batch_plan_plain_when_acceptance_is_low_and_min_gain_applies():
    costs = _linear_costs(2)
    assert _single([0.05, 0.05], [8, 8], costs).k == 0
    free = CostTable(verify_ms=(100.0, 101.0), draft_ms=0.0)  # k = 1 gains ~1% with α = 0.02
    assert best_batch_plan([[0.02]], [[1]], [0.0], free.t_verify).k == 1
    assert best_batch_plan([[0.02]], [[1]], [0.0], free.t_verify, min_gain=0.03).k == 0


def test_best_batch_plan_hybrid_per_row_drafters():
    """Drafter 0 = draft model (costs a forward), 1 = prompt lookup (free, only where an n-gram matched)."""
    costs = CostTable(verify_ms=tuple(60.0 + 5.0 * n for n in range(1, 10)), draft_ms=5.0)
    # row 0 has a good n-gram continuation, row 1 none: lookup for row 0; the draft model pays for row 1
    plan = best_batch_plan([[0.7, 0.9], [0.95, 0.5]], [[8, 8], [6, 0]], [5.0, 0.0], costs.t_verify)
    assert plan.k > 0 and plan.drafters == (1, 0)
    # the draft model barely accepts: its forward is not paid; lookup alone for the row that has one
    plan = best_batch_plan([[0.1, 0.1], [0.95, 0.5]], [[8, 8], [6, 0]], [5.0, 0.0], costs.t_verify)
    assert plan.k > 0 and plan.drafters[0] == 1
    assert plan.goodput == pytest.approx(1000.0 * ((1 - 0.95 ** (plan.k + 1)) / 0.05 + 1.0) / costs.t_verify(plan.k + 1))


def test_batch_controller_uses_the_current_batch_size_and_per_row_alpha():
    seen = []

    def costs_for(b: int) -> CostTable:
        seen.append(b)
        return _linear_costs(b)

    ctl = BatchGoodputController(costs_for, batch=3, draft_models=[True], min_gain=0.0)
    first = ctl.choose([[8, 8, 8]], [0])
    assert seen == [3] and len(set(first.ks)) == 1 and first.ks[0] > 0
    for _ in range(10):
        ctl.observe((0, 0, 0), [4, 4, 4], [4, 0, 4])  # row 1 never accepts
    alphas = ctl.estimators[0]
    assert alphas[1].alpha < 0.3 < 0.8 < alphas[0].alpha
    ctl.select(torch.tensor([0, 2]))  # row 1 finished
    decision = ctl.choose([[8, 2]], [0])
    assert seen[-1] == 2 and decision.ks[1] <= 2 and len(decision.alphas) == 2


def test_batch_fixed_controller_caps_by_upper_bound():
    assert BatchFixedController(3).choose([[8, 1, 0]], [0]).ks == (3, 1, 0)
    with pytest.raises(ValueError, match=">= 0"):
        BatchFixedController(-1)


def _alone(model, tokens: list[int]) -> torch.Tensor:
    """Last-position logits [V] of one unpadded row."""
    return hf_compat.forward_logits(model, torch.tensor([tokens]), hf_compat.new_cache(model), keep=1)[0, -1]


@torch.no_grad()
def test_ragged_cache_rows_compute_what_they_would_alone(tiny_factory):
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
