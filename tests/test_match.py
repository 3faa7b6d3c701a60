"""Prompt lookup priced by its match length and taught by hindsight on every step."""

from __future__ import annotations

import pytest
import torch
from conftest import decide

from hf_adaspec.costs.table import CostTable
from hf_adaspec.engine.hindsight import hindsight
from hf_adaspec.policy.acceptance import ConfidenceAcceptance
from hf_adaspec.policy.confidence import ConfidenceCalibrator
from hf_adaspec.policy.controller import AdaptiveController, StepView
from hf_adaspec.policy.decision import StepOutcome
from hf_adaspec.policy.match import (
    EDGES,
    LOOKUP_START_ALPHA,
    MatchAcceptance,
    MatchMemory,
    MatchTable,
    bucket,
)
from hf_adaspec.proposers.prompt_lookup import find_match


def test_find_match_counts_how_far_back_the_match_reaches():
    tokens = torch.tensor([1, 2, 3, 4, 5, 9, 9, 2, 3, 4])  # the last 3 tokens also end at index 3
    continuation, m = find_match(tokens, 3, 1, 4)
    assert continuation.tolist() == [5, 9, 9, 2] and m == 3  # 1 before "2 3 4" differs from 9
    tokens = torch.tensor([7, 1, 2, 3, 4, 5, 8, 7, 1, 2, 3, 4])
    continuation, m = find_match(tokens, 3, 1, 2)
    assert continuation.tolist() == [5, 8] and m == 5  # "7 1 2 3 4" matches: 5 tokens, though the n-gram is 3
    assert find_match(torch.tensor([1, 2, 3]), 3, 1, 4)[1] == 0  # no earlier occurrence


def test_buckets_cover_every_match_length():
    assert [bucket(m) for m in (1, 2, 3, 4, 5, 6, 7, 8, 31, 32, 500)] == [0, 1, 2, 3, 3, 4, 4, 5, 8, 9, 9]
    assert bucket(EDGES[-1]) == len(EDGES) - 1


def test_match_table_learns_per_bucket_and_prices_a_proposal_as_a_growing_match():
    table = MatchTable(start=0.4, strength=2.0, decay=1.0)
    assert table.path(1, 3) == pytest.approx((0.4, 0.16, 0.064))
    for _ in range(50):
        table.observe(1, 3, 0)  # at match length 1 the first token always fails
        table.observe(8, 3, 3)  # at 8 and beyond every token is accepted
    assert table.alpha(1) < 0.05 and table.alpha(8) > 0.95 and table.alpha(20) > 0.95
    assert list(table.rates) == sorted(table.rates)  # never lower for a longer match
    p = table.path(8, 2)
    assert p[1] == pytest.approx(table.alpha(8) * table.alpha(9))  # P_2 = α(8)·α(9)
    with pytest.raises(ValueError):
        table.observe(3, 2, 3)


def test_an_unseen_bucket_does_not_drag_a_seen_one_down():
    table = MatchTable(start=0.37, strength=2.0, decay=0.98)
    for _ in range(30):
        table.observe(3, 4, 4)
    assert table.alpha(3) > 0.9 and table.alpha(30) >= table.alpha(3)


def test_hindsight_compares_only_what_the_step_emitted():
    assert hindsight([4, 5, 6, 7], [4, 5, 9]) == (3, 2)
    assert hindsight([4, 5], [4, 5, 6]) == (2, 2)
    assert hindsight([4, 5, 6], [4]) == (1, 1)  # censored: 1 token emitted
    assert hindsight([7, 5], [4, 5]) == (2, 0)  # a later match after a miss does not count
    assert hindsight([], [4]) == (0, 0)


def test_lookup_learns_while_the_draft_model_is_chosen_and_then_takes_over():
    """The failure the hindsight fixes: with the draft chosen every step, lookup's rate used to stay at
    its pessimistic start; scored in hindsight, a lookup that would have been accepted wins."""
    costs = CostTable(verify_ms=(100.0, 102.0, 104.0, 106.0, 108.0, 110.0, 112.0, 114.0, 116.0), draft_ms=30.0)
    lookup = MatchAcceptance(1, MatchMemory().table_for("l"))
    draft = ConfidenceAcceptance(1, ConfidenceCalibrator())
    ctl = AdaptiveController(lambda b: costs, [draft, lookup], [True, False])
    view = StepView(((8,), (8,)), (0, 0), 64, ((0,), (4,)))
    first = decide(ctl, view)
    assert first.drafters == (0,) and lookup.alpha(0) == pytest.approx(LOOKUP_START_ALPHA)
    for _ in range(12):  # the draft proposes 2 and gets 1 accepted; lookup's whole offer would have matched
        ctl.observe(decide(ctl, view), StepOutcome((0,), (2,), (1,), ((0.6, 0.3),), (None, ((2, 2),))))
    assert lookup.alpha(0) > 0.8
    assert decide(ctl, view).drafters == (1,)
