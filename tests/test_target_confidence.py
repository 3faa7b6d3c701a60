"""The target's confidence as a signal on plain steps: the bin map by hand, which positions it learns
from, the confidence controller returning to drafting when the target turns sure, and the engine's wiring."""

from __future__ import annotations

import pytest
import torch

import hf_adaspec.integration as integration
from hf_adaspec.acceptance import AcceptanceEstimator, AcceptanceMemory, AcceptancePrior
from hf_adaspec.confidence import ConfidenceCalibrator, ConfidenceController
from hf_adaspec.controller import DraftOption, DrafterCosts, GoodputController
from hf_adaspec.costs import CostTable
from hf_adaspec.target_confidence import TargetConfidenceMap, interpolate_bins, judged_positions

FLAT = CostTable(verify_ms=(10.0,) * 9, draft_ms=3.0)
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]


def test_interpolate_bins_by_hand():
    centres, values = (0.25, 0.75), (0.2, 0.6)
    assert interpolate_bins(centres, values, 0.1) == 0.2 and interpolate_bins(centres, values, 0.9) == 0.6
    assert interpolate_bins(centres, values, 0.5) == pytest.approx(0.4)
    assert interpolate_bins((0.05, 0.15, 0.25), (0.0, 1.0, 3.0), 0.2) == pytest.approx(2.0)


def test_map_starts_at_identity_and_learns_bin_means():
    m = TargetConfidenceMap(n_bins=10, prior_strength=2.0)
    assert m.predict(0.35) == pytest.approx(0.35) and m.predict(0.95) == pytest.approx(0.95)
    m.update((0.97, 0.91), (0.5, 0.5))  # both in the last bin: (2·0.95 + 0.5 + 0.5) / 4
    assert m.predict(0.95) == pytest.approx(0.725) and m.predict(1.0) == pytest.approx(0.725)
    assert m.predict(0.35) == pytest.approx(0.35)  # other bins untouched


@pytest.mark.parametrize("top, q", [((0.5,), ()), ((1.2,), (0.5,)), ((0.5,), (-0.1,))])
def test_map_rejects_bad_pairs(top, q):
    with pytest.raises(ValueError):
        TargetConfidenceMap().update(top, q)
    with pytest.raises(ValueError, match="n_bins"):
        TargetConfidenceMap(n_bins=0)


@pytest.mark.parametrize("drafted, accepted, judged", [(0, 0, 0), (3, 0, 1), (3, 1, 2), (3, 3, 3)])
def test_judged_positions(drafted, accepted, judged):
    assert judged_positions(drafted, accepted) == judged


def _stuck_controller(target_confidence: bool) -> ConfidenceController:
    """P = c (no optimism), verify 10 ms, draft 3 ms: a request whose c̄ starts at 0.15 does not draft."""
    return ConfidenceController(FLAT, DrafterCosts(3.0), ConfidenceCalibrator(token_mean=0.15, optimism=0.0),
                                target_confidence=target_confidence)


@pytest.mark.parametrize("use", [True, False])
def test_plain_steps_on_sure_text_bring_drafting_back_only_with_the_target_signal(use):
    ctl = _stuck_controller(use)
    assert ctl.choose([DraftOption(0, 4)], horizon=64).k == 0 and ctl.uses_target is use
    for _ in range(12):  # plain steps where the target is sure; the map's identity prior says q ≈ 0.99
        ctl.observe(0, drafted=0, accepted=0)
        if ctl.uses_target:  # as the engine does
            ctl.observe_target(0, 0, 0, (), (0.99,))
    assert (ctl.choose([DraftOption(0, 4)], horizon=64).k == 4) is use
    expected = (4 * 0.15 + 12 * ctl.calibrator.target_map.predict(0.99)) / 16 if use else 0.15
    assert ctl.c_bar.value == pytest.approx(expected)


def test_drafted_steps_teach_the_map_only_where_a_draft_was_judged_on_an_accepted_prefix():
    ctl = _stuck_controller(True)
    ctl.observe(0, drafted=3, accepted=1, confidences=(0.9, 0.8, 0.7))
    ctl.observe_target(0, 3, 1, (0.9, 0.8, 0.7), (0.95, 0.45))  # n+1 = 2 positions verified on a kept prefix
    tmap, before = ctl.calibrator.target_map, TargetConfidenceMap()
    assert tmap.weights[9] == before.weights[9] + 1 and tmap.sums[9] == pytest.approx(before.sums[9] + 0.9)
    assert tmap.weights[4] == before.weights[4] + 1 and tmap.sums[4] == pytest.approx(before.sums[4] + 0.8)
    assert sum(tmap.weights) == sum(before.weights) + 2
    assert ctl.c_bar.value == pytest.approx((4 * 0.15 + 0.9 + 0.8 + 0.7) / 7)  # real q's only, no prediction


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_engine_reports_the_targets_top_probability_at_each_kept_position(models, monkeypatch):
    seen = []
    real = ConfidenceController.observe_target
    monkeypatch.setattr(ConfidenceController, "observe_target",
                        lambda self, *args: (seen.append(args), real(self, *args)))
    kwargs = dict(assistant_model=models["noisy_copy"], speculation="confidence", speculation_costs=FLAT,
                  max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    models["target"].generate(PROMPT, **kwargs)
    assert not seen  # off by default: no softmax over the vocabulary for it
    out = models["target"].generate(PROMPT, target_confidence=True, **kwargs)
    steps = out.speculation.steps
    assert len(seen) == len(steps) and any(s.k for s in steps)
    for (_, drafted, accepted, confidences, top), step in zip(seen, steps, strict=True):
        assert (drafted, accepted, len(confidences), len(top)) == (step.k, step.accepted, step.k, step.accepted + 1)
    with torch.no_grad():  # the first step's position 0: the target's next-token distribution after the prefill
        first = models["target"](out.sequences[:, : PROMPT.shape[1] + 1]).logits[0, -1].softmax(-1).max()
    assert seen[0][4][0] == pytest.approx(float(first), rel=1e-4)


def test_add_expected_is_one_soft_trial():
    est = AcceptanceEstimator(AcceptancePrior(mean=0.5, strength=4.0))
    est.add_expected(0.9)
    assert est.alpha == pytest.approx((2.0 + 0.9) / 5.0)
    with pytest.raises(ValueError, match="alpha"):
        est.add_expected(1.5)


def _goodput(maps) -> GoodputController:
    """Verify 10 ms, draft 4 ms, α prior 0.3 (a k > 0 does not pay), prompt lookup as second drafter."""
    return GoodputController(FLAT, [DrafterCosts(4.0), DrafterCosts()], [AcceptancePrior(0.3), None],
                             min_gain=0.0, target_maps=maps)


@pytest.mark.parametrize("use", [True, False])
def test_goodput_alpha_follows_the_targets_confidence_while_not_drafting(use):
    ctl = _goodput([TargetConfidenceMap(), None] if use else None)
    options = [DraftOption(0, 4), DraftOption(1, 0)]
    assert ctl.choose(options, horizon=64).k == 0 and ctl.uses_target is use
    for _ in range(20):  # plain steps on text the target is sure of
        ctl.observe(0, 0, 0)
        if ctl.uses_target:  # as the engine does
            ctl.observe_target(0, 0, 0, (), (0.99,))
    assert (ctl.choose(options, horizon=64).k > 0) is use
    assert ctl.estimators[1].alpha == pytest.approx(AcceptanceEstimator().alpha)  # no map: prior only


def test_goodput_learns_acceptance_given_confidence_from_its_own_drafts():
    tmap = TargetConfidenceMap()
    ctl = _goodput([tmap, None])
    ctl.observe(0, drafted=4, accepted=2)
    ctl.observe_target(0, 4, 2, (0.9, 0.9, 0.9, 0.9), (0.95, 0.95, 0.15))  # judged: accepted, accepted, rejected
    assert tmap.weights[9] == 4.0 and tmap.sums[9] == pytest.approx(2 * 0.95 + 2.0)
    assert tmap.weights[1] == 3.0 and tmap.sums[1] == pytest.approx(2 * 0.15 + 0.0)
    assert ctl.estimators[0].alpha == pytest.approx((0.3 * 4 + 2) / (4 + 3))
    ctl.observe(1, drafted=2, accepted=2)  # a prompt-lookup step: the draft model's α keeps its counts
    ctl.observe_target(1, 2, 2, (), (0.95, 0.95, 0.95))  # and gets 3 soft trials at (2·0.95 + 2) / 4 = 0.975
    assert ctl.estimators[0].alpha == pytest.approx((1.2 + 2 + 3 * 0.975) / (4 + 3 + 3))
    assert sum(tmap.weights) == 23.0  # the map learns only from the draft model's own drafts


def test_memory_keeps_one_target_map_per_drafter():
    memory = AcceptanceMemory()
    assert memory.target_map_for("a") is memory.target_map_for("a") is not memory.target_map_for("b")


@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("use", [True, False])
def test_hybrid_gets_a_target_map_for_its_draft_model_only(models, monkeypatch, use):
    seen, real = [], integration.speculative_decode

    def spy(target, input_ids, proposers, controller, settings):
        seen.append(controller)
        return real(target, input_ids, proposers, controller, settings)

    monkeypatch.setattr(integration, "speculative_decode", spy)
    memory = AcceptanceMemory()
    for _ in range(2):
        integration._speculative_entry(models["target"].generate, integration.SpeculationState(memory),
                                       speculation="hybrid", inputs=PROMPT,
                                       assistant_model=models["noisy_copy"], speculation_costs=FLAT, max_new_tokens=8,
                                       do_sample=False, target_confidence=use)
    first, second = seen
    assert first.target_maps[1] is None and (first.target_maps[0] is not None) is use
    assert first.target_maps[0] is second.target_maps[0]  # one map per pair, kept across requests
