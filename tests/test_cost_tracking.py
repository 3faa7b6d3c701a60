"""Online cost correction: decayed ratios by hand, the tracker's scaled costs, a controller that stops
drafting once drafts prove expensive, and the engine/integration wiring on tiny Llamas."""

from __future__ import annotations

import pytest
import torch

import hf_adaspec.integration as integration
from hf_adaspec.acceptance import AcceptancePrior
from hf_adaspec.controller import DraftOption, DrafterCosts, GoodputController
from hf_adaspec.cost_tracking import CostScale, CostScaleMemory, CostTracker, DecayedRatio, scaled_costs
from hf_adaspec.costs import CostTable

TABLE = CostTable(verify_ms=(100.0, 110.0, 120.0, 130.0), draft_ms=20.0)
DRAFT, LOOKUP = DrafterCosts(draft_ms=20.0, catchup_ms=5.0), DrafterCosts()
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]


def test_decayed_ratio_by_hand():
    ratio = DecayedRatio(decay=0.5, prior=10.0)
    assert ratio.value == 1.0
    ratio.add(30.0, 10.0)
    assert ratio.value == pytest.approx((30 + 10) / (10 + 10))
    ratio.add(10.0, 10.0)  # sums: realized 0.5·30 + 10 = 25, predicted 0.5·10 + 10 = 15
    assert ratio.value == pytest.approx((25 + 10) / (15 + 10))
    assert DecayedRatio(0.5, 10.0, start=2.0).value == 2.0
    assert DecayedRatio(0.9, 181.96202245060593, start=1.5355596638779787).value == 1.5355596638779787


@pytest.mark.parametrize("decay, prior, start", [(1.0, 1.0, 1.0), (-0.1, 1.0, 1.0), (0.5, 0.0, 1.0), (0.5, 1.0, 0.0)])
def test_decayed_ratio_rejects_bad_settings(decay, prior, start):
    with pytest.raises(ValueError, match="decay must be in"):
        DecayedRatio(decay, prior, start)


def test_scaled_costs_multiplies_verify_and_each_drafter():
    table, drafters = scaled_costs(TABLE, [DRAFT, LOOKUP], CostScale(1.5, (2.0, 3.0)))
    assert table.verify_ms == (150.0, 165.0, 180.0, 195.0) and table.draft_ms == TABLE.draft_ms
    assert drafters == (DrafterCosts(40.0, 5.0), DrafterCosts(0.0, 0.0))  # catch-up kept as measured


def test_tracker_learns_verify_from_every_step_and_draft_only_without_catchup():
    tracker = CostTracker(TABLE, [DRAFT, LOOKUP], decay=0.0)  # decay 0: the latest step and the prior
    tracker.observe(0, 0, 0, 0.0, 300.0)  # plain step: verify 300 ms against t_verify(1) = 100
    assert tracker.scale == CostScale((300 + 200) / (100 + 200), (1.0, 1.0))
    tracker.observe(0, 3, 500, 900.0, 130.0)  # a catch-up step: its draft time says nothing per token
    assert tracker.scale.draft == (1.0, 1.0)
    tracker.observe(0, 3, 0, 180.0, 130.0)  # 3 tokens in 180 ms against 3·20 = 60
    assert tracker.scale.draft[0] == pytest.approx((180 + 40) / (60 + 40))
    tracker.observe(1, 2, 0, 5.0, 120.0)  # prompt lookup costs nothing: its ratio stays 1
    assert tracker.scale.draft[1] == 1.0
    assert tracker.drafters[0].draft_ms == pytest.approx(20.0 * tracker.scale.draft[0])
    assert tracker.costs.t_verify(3) == pytest.approx(120.0 * tracker.scale.verify)


def test_tracker_resumes_from_a_previous_scale_and_ignores_a_mismatched_one():
    start = CostScale(1.2, (1.8, 1.0))
    tracker = CostTracker(TABLE, [DRAFT, LOOKUP], start=start)
    assert tracker.scale == start and tracker.drafters[0].draft_ms == pytest.approx(36.0)
    assert CostTracker(TABLE, [DRAFT], start=start).scale == CostScale(1.2, (1.0,))


def _controller(adapt: bool) -> GoodputController:
    flat = CostTable(verify_ms=(100.0,) * 9, draft_ms=20.0)
    return GoodputController(flat, [DrafterCosts(20.0)], [AcceptancePrior(0.7, 1e6)], 0.03, adapt_costs=adapt)


@pytest.mark.parametrize("adapt", [True, False])
def test_controller_stops_drafting_once_drafts_prove_expensive_only_when_adapting(adapt):
    ctl = _controller(adapt)
    assert ctl.choose([DraftOption(0, 8)], horizon=64).k > 0  # at 20 ms a token, α 0.7 pays
    for _ in range(10):
        k = 4
        ctl.observe(0, k, 3)
        ctl.observe_time(0, k, 0, k * 150.0, 100.0)  # each draft token really took 150 ms
    decision = ctl.choose([DraftOption(0, 8)], horizon=64)
    assert (decision.k == 0) is adapt
    assert ctl.drafters[0].draft_ms == (pytest.approx(20.0 * ctl.tracker.scale.draft[0]) if adapt else 20.0)


def test_engine_reports_each_steps_times_and_catchup(models, monkeypatch, one_thread):
    seen = []
    monkeypatch.setattr(GoodputController, "observe_time", lambda self, *args: seen.append(args))
    out = models["target"].generate(PROMPT, assistant_model=models["noisy_copy"], speculation="adaptive",
                                    speculation_costs=CostTable((10.0,) * 9, 1.0), max_new_tokens=20,
                                    do_sample=False, return_dict_in_generate=True)
    steps = out.speculation.steps
    assert len(seen) == len(steps) and any(s.k for s in steps)
    for (drafter, drafted, catchup, draft_ms, verify_ms), step in zip(seen, steps, strict=True):
        assert (drafter, drafted, draft_ms, verify_ms) == (0, step.k, step.draft_ms, step.verify_ms)
    assert seen[0][2] == PROMPT.shape[1] + 1 - 2  # the draft has seen nothing: prompt + 1st token, less 2


def _spy_controllers(monkeypatch) -> list:
    """Every controller the integration hands to the engine, with its tracker's ratios at the start."""
    seen, real_decode = [], integration.speculative_decode

    def spy(target, input_ids, proposers, controller, settings):
        seen.append((controller, controller.tracker.scale))
        return real_decode(target, input_ids, proposers, controller, settings)

    monkeypatch.setattr(integration, "speculative_decode", spy)
    return seen


def test_costs_given_as_is_are_measured_but_not_corrected(models, monkeypatch, one_thread):
    seen, given = _spy_controllers(monkeypatch), CostTable((10.0,) * 9, 1.0)
    out = models["target"].generate(PROMPT, assistant_model=models["noisy_copy"], speculation="adaptive",
                                    speculation_costs=given, max_new_tokens=12, do_sample=False,
                                    return_dict_in_generate=True)
    (controller, _), = seen
    assert out.speculation.cost_scale != CostScale(1.0, (1.0,))  # a tiny model is not 10 ms a forward
    assert controller.costs is given and controller.drafters[0].draft_ms == 1.0


@pytest.mark.parametrize("adapt", [True, False])
def test_measured_costs_are_corrected_and_remembered_across_requests(models, monkeypatch, private_cache,
                                                                     one_thread, adapt):
    seen, scales = _spy_controllers(monkeypatch), CostScaleMemory()
    kwargs = dict(speculation="confidence", assistant_model=models["noisy_copy"], inputs=PROMPT, max_new_tokens=12,
                  do_sample=False, return_dict_in_generate=True, max_speculative_tokens=3, adapt_costs=adapt)
    entry, target = integration._speculative_entry, models["target"]
    first = entry(target.generate, integration.SpeculationState(cost_scales=scales), **kwargs)
    entry(target.generate, integration.SpeculationState(cost_scales=scales), **kwargs)
    (controller, start), (_, resumed) = seen
    assert start == CostScale(1.0, (1.0,)) and first.speculation.cost_scale != start  # measured either way
    assert resumed == first.speculation.cost_scale  # the pair's next request starts from it
    tracker = controller.tracker
    assert (controller.costs is tracker.base) is not adapt
    factor = tracker.scale.verify if adapt else 1.0
    assert controller.costs.t_verify(1) == pytest.approx(tracker.base.t_verify(1) * factor)
