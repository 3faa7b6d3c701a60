"""Per-request recalibration: ρ = (O + w) / (E + w) scales the pooled confidence calibration."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from hf_adaspec.confidence import ConfidenceCalibrator, ConfidenceController
from hf_adaspec.controller import DraftOption, DrafterCosts
from hf_adaspec.costs import CostTable
from hf_adaspec.hybrid_confidence import LOOKUP, HybridConfidenceController
from hf_adaspec.config import SpeculationConfig
from hf_adaspec.integration import SpeculationRequest
from hf_adaspec.modes import build_controller
from hf_adaspec.proposers import DraftModelProposer, PromptLookupProposer
from hf_adaspec.recalibration import RequestRecalibration, recalibration_ratio

FLAT = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # verification costs 10 ms for 1..9 tokens
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]


@pytest.mark.parametrize("observed, expected, weight, ratio", [
    (0.0, 0.0, 4.0, 1.0),  # no evidence: the pooled calibration as is
    (1.0, 5.0, 3.0, 0.5),
    (6.0, 2.0, 2.0, 2.0),  # more accepted than expected: ρ > 1
    (0.0, 1000.0, 4.0, 4.0 / 1004.0),
])
def test_recalibration_ratio_is_observed_over_expected_shrunk_to_one(observed, expected, weight, ratio):
    assert recalibration_ratio(observed, expected, weight) == pytest.approx(ratio)


@pytest.mark.parametrize("args", [(-1.0, 1.0, 1.0), (1.0, -1.0, 1.0), (1.0, 1.0, 0.0)])
def test_recalibration_ratio_rejects_bad_input(args):
    with pytest.raises(ValueError):
        recalibration_ratio(*args)


def test_request_recalibration_updates_scales_and_relaxes():
    r = RequestRecalibration(weight=2.0, decay=0.5)
    r.update([0.9, 0.8, 0.7], accepted=0)  # E = 2.4, O = 0
    assert r.ratio == pytest.approx(2.0 / 4.4)
    assert r.scale(0.9) == pytest.approx(0.9 * 2.0 / 4.4)
    r.relax()  # O, E halve
    assert r.ratio == pytest.approx(2.0 / 3.2)
    r.update([0.5], accepted=1)
    assert r.ratio == pytest.approx(3.0 / 3.7)
    assert RequestRecalibration(observed=10.0, expected=1.0).scale(0.9) == 1.0  # ρ > 1 is capped at P = 1
    with pytest.raises(ValueError):
        r.update([0.5], accepted=2)
    with pytest.raises(ValueError):
        RequestRecalibration(decay=0.0)


def test_inactive_recalibration_keeps_the_pooled_calibration():
    r = RequestRecalibration(active=False)
    r.update([0.9, 0.9], accepted=0)
    assert r.ratio == 1.0 and r.scale(0.9) == 0.9


def _confident_controller(recalibrate: bool) -> ConfidenceController:
    """A pooled calibration that predicts P = c and barely moves (1000 pseudo-trials per bin); 5 ms drafts,
    10 ms verification: k = 1 pays iff P_1 > 0.5."""
    calibrator = ConfidenceCalibrator(token_mean=0.9, optimism=0.0, prior_strength=1000.0)
    return ConfidenceController(FLAT, DrafterCosts(draft_ms=5.0), calibrator, min_gain=0.0, recalibrate=recalibrate)


@pytest.mark.parametrize("recalibrate", [False, True])
def test_a_confident_but_wrong_request_stops_drafting_only_when_recalibrated(recalibrate):
    ctl = _confident_controller(recalibrate)
    assert ctl.choose([DraftOption(0, 4)], horizon=64).k == 4
    for _ in range(3):  # confident drafts, every one rejected
        ctl.observe(0, drafted=2, accepted=0, confidences=(0.9, 0.9))
    assert ctl.choose([DraftOption(0, 4)], horizon=64).k == (0 if recalibrate else 4)
    for _ in range(30):  # plain steps: ρ drifts back to 1 and the request tries again
        ctl.observe(0, drafted=0, accepted=0)
    assert ctl.choose([DraftOption(0, 4)], horizon=64).k == 4


def test_a_lookup_step_leaves_the_draft_models_ratio_alone():
    calibrator = ConfidenceCalibrator(token_mean=0.9, optimism=0.0, prior_strength=1000.0)
    ctl = HybridConfidenceController(FLAT, [DrafterCosts(draft_ms=3.0), DrafterCosts()], calibrator, recalibrate=True)
    ctl.observe(0, drafted=2, accepted=0, confidences=(0.9, 0.9))
    before = ctl.recalibration.ratio
    ctl.observe(LOOKUP, drafted=3, accepted=0)
    assert ctl.recalibration.ratio == before < 1.0
    ctl.observe(0, drafted=0, accepted=0)
    assert before < ctl.recalibration.ratio < 1.0


@pytest.mark.parametrize("mode", ["confidence", "hybrid-confidence"])
@pytest.mark.parametrize("flag", [False, True])
def test_recalibrate_reaches_the_confidence_controllers(models, mode, flag):
    draft = models["other_seed"]
    request = SpeculationRequest(SpeculationConfig(speculation=mode, recalibrate=flag), draft, costs=FLAT)
    proposers = [DraftModelProposer(draft, LogitsProcessorList(), False), PromptLookupProposer()]
    controller = build_controller(models["target"], request, proposers[: 2 if mode == "hybrid-confidence" else 1], 24)
    assert controller.recalibration.active is flag


@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("mode", ["confidence", "hybrid-confidence"])
def test_recalibrated_greedy_equals_plain(models, mode):
    plain = models["target"].generate(PROMPT, max_new_tokens=40, do_sample=False)
    out = models["target"].generate(PROMPT, speculation=mode, assistant_model=models["other_seed"], recalibrate=True,
                                    speculation_costs=FLAT, max_new_tokens=40, do_sample=False,
                                    return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert any(s.k for s in out.speculation.steps)
