"""Cost tracking (``costs.tracking``): the profile's prices corrected by realized step times, pure math
first, then through the engine on the replay's virtual clock."""

from __future__ import annotations

import math

import pytest

from hf_adaspec.costs.table import CostTable
from hf_adaspec.costs.tracking import (
    DECAY,
    PRIOR_STEPS,
    CostMemory,
    CostTracker,
    StepTiming,
)

TABLE = CostTable((50.0, 55.0, 60.0, 65.0, 70.0), 20.0, key="pair", draft_catchup_ms=4.0)


def _step(tracker: CostTracker, width: int, verify_x: float, draft_x: float | None = None, catchup: int = 1) -> None:
    """One step at ``width`` whose verification ran ``verify_x`` times its price and, with ``draft_x``, whose
    k = width - 1 draft tokens (and ``catchup`` catch-up tokens) ran ``draft_x`` times theirs."""
    k = width - 1
    priced_draft = k * TABLE.draft_ms + catchup * TABLE.draft_catchup_ms if draft_x is not None else 0.0
    realized_draft = priced_draft * draft_x if draft_x is not None else 0.0
    tracker.observe(StepTiming(width, priced_draft, TABLE.t_verify(width), realized_draft,
                               TABLE.t_verify(width) * verify_x, k if draft_x is not None else 0,
                               catchup if draft_x is not None else 0))


def test_nothing_observed_leaves_the_costs_as_priced():
    assert CostTracker().corrected(TABLE) is TABLE
    assert CostTracker().factors(3).verify == (1.0, 1.0, 1.0)


def test_a_uniform_slowdown_scales_every_price():
    tracker = CostTracker()
    for i in range(2000):
        _step(tracker, 1 + i % 5, 2.0, 2.0 if i % 5 else None)
    fixed = tracker.corrected(TABLE)
    for n in range(1, 6):
        assert fixed.t_verify(n) == pytest.approx(2.0 * TABLE.t_verify(n), rel=0.03)
    assert fixed.draft_ms == pytest.approx(40.0, rel=0.03) and fixed.draft_catchup_ms == pytest.approx(8.0, rel=0.03)


def test_the_draft_learns_its_own_drift_apart_from_verification():
    """Verification 3x its price (taught by costless steps), a draft token 1.5x: the draft's factor is its
    own, learned from what its steps took beyond their verification (pulled a little toward verification's
    by the evidence it loses on the costless steps between)."""
    tracker = CostTracker()
    for i in range(2000):
        _step(tracker, 4, 3.0, 1.5 if i % 2 else None)
    assert tracker.verify_factor(4) == pytest.approx(3.0, rel=0.01)
    assert 1.45 < tracker.draft_factor < 1.7


def test_until_the_draft_is_seen_it_drifts_with_verification():
    tracker = CostTracker()
    for _ in range(100):
        _step(tracker, 1, 2.0)
    assert tracker.draft.n == 0 and tracker.draft_factor == pytest.approx(tracker.verify_factor(5))


def test_each_width_keeps_its_own_drift_and_an_unseen_width_takes_the_pool():
    tracker = CostTracker()
    for i in range(600):
        _step(tracker, 1 if i % 2 else 8, 2.0 if i % 2 else 1.0)
    assert tracker.verify_factor(1) > 1.7 and tracker.verify_factor(8) < 1.2
    assert tracker.verify_factor(3) == pytest.approx(math.exp(tracker.verify.mean * tracker.verify.shrink))


def test_a_prompt_catch_up_does_not_teach_the_draft_its_price():
    """Steps whose catch-up outweighs their drafted tokens (a prompt ingested) leave the draft's factor at
    verification's, however slow they ran."""
    tracker = CostTracker()
    for i in range(400):
        _step(tracker, 3, 2.0, 8.0 if i % 2 else None, catchup=300)
    assert tracker.draft.n == 0 and tracker.draft_factor == pytest.approx(tracker.verify_factor(7))
    assert tracker.draft_factor == pytest.approx(2.0, rel=0.05)


def test_the_drafts_evidence_ages_when_it_is_not_measured():
    """A drafter priced out is priced back toward verification's factor as its evidence ages."""
    tracker = CostTracker()
    for i in range(200):
        _step(tracker, 3, 1.0, 0.5 if i % 2 else None)
    learned, evidence = tracker.draft_factor, tracker.draft.evidence
    assert learned < 0.6
    for _ in range(300):
        _step(tracker, 1, 1.0)  # plain steps: no draft observed
    assert tracker.draft.evidence == pytest.approx(evidence * (1 - DECAY) ** 300)
    assert learned < tracker.draft_factor < 1.0


def test_a_factor_moves_by_its_evidence():
    """One observation of a 2x slowdown moves the price 1 / (1 + PRIOR_STEPS) of the way (in logs)."""
    tracker = CostTracker()
    _step(tracker, 2, 2.0)
    assert tracker.verify_factor(2) == pytest.approx(2.0 ** (1 / (1 + PRIOR_STEPS)))


def test_times_that_are_not_positive_and_finite_are_ignored():
    tracker = CostTracker()
    tracker.observe(StepTiming(1, 0.0, 50.0, 0.0, math.nan, 0, 0))
    tracker.observe(StepTiming(1, 0.0, 50.0, 0.0, 0.0, 0, 0))
    tracker.observe(StepTiming(2, 20.0, 55.0, math.nan, 60.0, 1, 1))
    assert tracker.verify.n == 0 and tracker.draft.n == 0 and tracker.corrected(TABLE) is TABLE


def test_one_tracker_per_pair_and_the_factors_say_what_moved():
    memory = CostMemory()
    assert memory.tracker("pair") is memory.tracker("pair") and memory.tracker("other") is not memory.tracker("pair")
    for _ in range(100):
        _step(memory.tracker("pair"), 1, 2.0)
    factors = memory.tracker("pair").factors(2)
    assert factors.steps == 100 and factors.verify[0] > 1.8
    assert factors.describe().startswith(f"verification x{factors.verify[0]:.2f} (1 token) to x")
