"""Cost tracking: realized vs predicted step times correct the cost table once they drift beyond noise;
the controller then prices with the corrected costs; generate reports the corrections and stays lossless."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hf_adaspec.config import SpeculationConfig
from hf_adaspec.costs.table import CostTable
from hf_adaspec.costs.tracking import CostMemory, CostTracker
from hf_adaspec.engine.run import SpeculationState
from hf_adaspec.policy.acceptance import AcceptancePrior, IIDAcceptance
from hf_adaspec.policy.controller import AdaptiveController, FixedController, StepOutcome, StepView, step_ms

TABLE = CostTable(verify_ms=(50.0, 52.0, 54.0, 56.0, 58.0), draft_ms=10.0, draft_catchup_ms=2.0)


def _steps(tracker: CostTracker, n: int, width: int, draft_ratio: float, verify_ratio: float, noise: float = 0.0,
           seed: int = 0) -> None:
    rng = random.Random(seed)
    for _ in range(n):
        jitter = lambda: math.exp(rng.gauss(0.0, noise))  # noqa: E731
        tracker.observe(width, (20.0, 50.0), (20.0 * draft_ratio * jitter(), 50.0 * verify_ratio * jitter()))


def test_no_correction_before_min_steps_or_inside_the_band():
    tracker = CostTracker(min_steps=8, band=0.10)
    _steps(tracker, 7, 1, 2.0, 2.0)
    assert tracker.factors() == {} and tracker.corrected(TABLE) is TABLE
    quiet = CostTracker()
    _steps(quiet, 200, 1, 1.05, 0.96, noise=0.1)
    assert quiet.factors() == {} and quiet.corrected(TABLE) is TABLE


def test_noise_alone_is_not_a_drift():
    tracker = CostTracker(band=0.0)  # no dead band: only the standard error guards
    _steps(tracker, 10, 1, 1.0, 1.0, noise=0.8, seed=3)
    assert tracker.factors() == {}


def test_consistent_drift_scales_each_quantity():
    tracker = CostTracker()
    _steps(tracker, 30, 1, 2.0, 1.5)
    factors = tracker.factors()
    assert factors["draft"] == pytest.approx(2.0) and factors["verify@1"] == pytest.approx(1.5)
    table = tracker.corrected(TABLE)
    assert table.draft_ms == pytest.approx(20.0) and table.draft_catchup_ms == pytest.approx(4.0)
    assert table.verify_ms == pytest.approx(tuple(1.5 * t for t in TABLE.verify_ms))  # unseen widths: nearest


def test_each_width_keeps_its_own_factor():
    tracker = CostTracker()
    _steps(tracker, 30, 1, 1.0, 2.0)
    _steps(tracker, 30, 4, 1.0, 1.0)
    table = tracker.corrected(TABLE)
    assert table.verify_ms[0] == pytest.approx(100.0) and table.verify_ms[3:] == TABLE.verify_ms[3:]
    assert table.verify_ms[1] == pytest.approx(104.0)  # width 2 is nearest width 1
    assert table.draft_ms == TABLE.draft_ms


def test_zero_or_missing_times_teach_nothing():
    tracker = CostTracker(min_steps=1)
    tracker.observe(1, (0.0, 50.0), (5.0, math.nan))
    assert tracker.drifts == {}


@pytest.mark.parametrize("kwargs", [{"weight": 0.0}, {"weight": 1.5}, {"min_steps": 0}, {"band": -0.1}])
def test_bad_parameters_raise(kwargs):
    with pytest.raises(ValueError, match="CostTracker needs"):
        CostTracker(**kwargs)


def test_memory_keeps_one_tracker_per_key_and_batch():
    memory = CostMemory()
    assert memory.tracker_for("a", 1) is memory.tracker_for("a", 1)
    assert memory.tracker_for("a", 1) is not memory.tracker_for("a", 2)


def test_step_ms_prices_the_step_as_it_ran():
    outcome = StepOutcome((0, 1), (3, 4), (1, 2), ((), ()))  # row 0: paid drafter, 3 tokens; row 1: free, 4
    assert step_ms(TABLE, (True, False), (4, 0), outcome) == (3 * 10.0 + 4 * 2.0, 58.0)
    plain = StepOutcome((0,), (0,), (0,), ((),))
    assert step_ms(TABLE, (True, False), (4, 0), plain) == (0.0, 50.0)


def _controller(tracker: CostTracker | None) -> AdaptiveController:
    acceptance = IIDAcceptance(1, AcceptancePrior(0.8, 1e6))
    return AdaptiveController(lambda b: CostTable(verify_ms=(50.0,) * 9, draft_ms=10.0), [acceptance], [True],
                              tracker=tracker)


def test_controller_prices_with_corrected_costs_once_the_draft_drifts():
    tracker, view = CostTracker(), StepView(((8,),), (0,), 64)
    controller, fixed_costs = _controller(tracker), _controller(None)
    assert controller.decide(view).ks[0] > 0 and fixed_costs.decide(view).ks[0] > 0
    for _ in range(30):  # the draft forward takes 6x what the table says
        decision = controller.decide(view)
        k = decision.ks[0]
        outcome = StepOutcome((0,), (k,), (0,), ((),), draft_ms=60.0 * k, verify_ms=50.0)
        assert controller.price(outcome) == pytest.approx(sum(step_ms(tracker.corrected(controller.costs_for(1)),
                                                                      (True,), (0,), outcome)))
        controller.observe(outcome)
    assert tracker.factors()["draft"] == pytest.approx(6.0)
    assert controller.decide(view).ks[0] == 0 and fixed_costs.decide(view).ks[0] > 0


def test_fixed_controller_prices_without_tracking():
    fixed = FixedController(3, costs_for=lambda b: TABLE)
    outcome = StepOutcome((0,), (3,), (1,), ((),))
    assert math.isnan(fixed.price(outcome))  # before any decision
    fixed.decide(StepView(((5,),), (0,), 8))
    assert fixed.price(outcome) == pytest.approx(3 * 10.0 + 56.0)


def test_config_validates_cost_tracking():
    with pytest.raises(ValueError, match="cost_tracking must be True or False"):
        SpeculationConfig(cost_tracking=1)
    with pytest.raises(ValueError, match='belongs to speculation="adaptive"'):
        SpeculationConfig(speculation="fixed", num_speculative_tokens=2, cost_tracking=True)


def test_generate_with_cost_tracking_is_lossless_and_reports(models):
    target, draft = models["target"], models["noisy_copy"]
    ids = torch.tensor([[5, 9, 13, 2, 7, 5, 9, 13]])
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)
    state = SpeculationState()
    slow_draft = CostTable(verify_ms=(1.0,) * 9, draft_ms=0.001)  # the draft costs ~nothing: it drafts
    out = target.generate(ids, assistant_model=draft, speculation="adaptive", cost_tracking=True, max_new_tokens=24,
                          do_sample=False, speculation_costs=slow_draft, speculation_state=state,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    stats = out.speculation
    assert isinstance(stats.cost_factors, dict) and stats.to_dict()["cost_factors"] == stats.cost_factors
    assert all(math.isfinite(s.predicted_ms) and s.predicted_ms > 0 for s in stats.steps)
    assert len(state.costs.trackers) == 1  # learned into the request's state, per drafters and batch size
