"""speculation="hybrid-confidence": the choice between a plain step, prompt lookup and the
confidence-stopped draft model, what each step teaches it, and end to end on tiny random Llamas."""

from __future__ import annotations

import pytest
import torch

from hf_adaspec.acceptance import AcceptancePrior
from hf_adaspec.confidence import ConfidenceCalibrator
from hf_adaspec.controller import DraftOption, DrafterCosts
from hf_adaspec.costs import CostTable
from hf_adaspec.goodput import goodput
from hf_adaspec.hybrid_confidence import DRAFT, LOOKUP, HybridConfidenceController

FLAT = CostTable(verify_ms=(50.0,) * 9, draft_ms=20.0)  # verification costs 50 ms for 1..9 tokens
COSTS = [DrafterCosts(draft_ms=20.0, catchup_ms=2.0), DrafterCosts()]  # draft model, prompt lookup
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]


def _controller(c_bar: float, alpha_lookup: float, min_gain: float = 0.0) -> HybridConfidenceController:
    """Draft path P_j = c̄^j (identity calibration, held by a huge prior, no optimism); lookup α fixed."""
    calibrator = ConfidenceCalibrator(prior_strength=1e6, token_mean=c_bar, optimism=0.0)
    return HybridConfidenceController(FLAT, COSTS, calibrator, AcceptancePrior(alpha_lookup, 1e6), min_gain)


def test_lookup_wins_with_its_goodput_k_when_the_draft_is_unsure():
    decision = _controller(0.3, 0.9).choose([DraftOption(DRAFT, 8), DraftOption(LOOKUP, 5)], horizon=64)
    assert (decision.drafter, decision.k) == (LOOKUP, 5)  # free drafts, flat verification: all it offers
    assert decision.alpha == pytest.approx(0.9)
    assert decision.predicted_goodput == pytest.approx(goodput(0.9, 5, 0.0, FLAT.t_verify))


def test_lookup_k_is_cut_where_goodput_peaks():
    rising = CostTable(verify_ms=tuple(50.0 + 5.0 * n for n in range(9)), draft_ms=20.0)  # t_verify(n) = 45 + 5n
    ctl = HybridConfidenceController(rising, COSTS, ConfidenceCalibrator(prior_strength=1e6, token_mean=0.1,
                                                                         optimism=0.0), AcceptancePrior(0.5, 1e6))
    decision = ctl.choose([DraftOption(DRAFT, 8), DraftOption(LOOKUP, 8)], horizon=64)
    by_k = {k: goodput(0.5, k, 0.0, rising.t_verify) for k in range(9)}
    assert decision.drafter == LOOKUP and 0 < decision.k < 8
    assert decision.k == max(by_k, key=by_k.get)


def test_draft_model_wins_at_its_upper_bound_when_lookup_has_no_match():
    decision = _controller(0.95, 0.9).choose([DraftOption(DRAFT, 8), DraftOption(LOOKUP, 0)], horizon=64)
    assert (decision.drafter, decision.k) == (DRAFT, 8)  # the stop rule then ends the proposal


def test_draft_model_wins_when_lookup_acceptance_is_poor():
    decision = _controller(0.95, 0.05).choose([DraftOption(DRAFT, 8), DraftOption(LOOKUP, 8)], horizon=64)
    assert (decision.drafter, decision.k) == (DRAFT, 8)


def test_plain_step_when_neither_pays():
    decision = _controller(0.05, 0.01, min_gain=0.03).choose([DraftOption(DRAFT, 8), DraftOption(LOOKUP, 8)], 64)
    assert decision.k == 0
    assert decision.predicted_goodput == pytest.approx(1000.0 / 50.0)


def test_only_the_draft_model_is_stopped_by_confidence():
    ctl = _controller(0.9, 0.5)
    assert ctl.stop_rule(LOOKUP) is None
    stop = ctl.stop_rule(DRAFT)
    assert stop(1, (0.01,)) and not stop(1, (0.99,))  # an unsure first token ends the proposal


def test_each_step_teaches_its_own_drafter():
    ctl = HybridConfidenceController(FLAT, COSTS, ConfidenceCalibrator(), AcceptancePrior(0.6, 2.0))
    trials, c_bar = sum(ctl.calibrator.trials), ctl.c_bar.value
    ctl.observe(LOOKUP, 4, 0)
    assert ctl.lookup.alpha < 0.6  # four rejected lookup tokens
    assert sum(ctl.calibrator.trials) == trials and ctl.c_bar.value == c_bar  # the draft learned nothing
    lookup_alpha = ctl.lookup.alpha
    ctl.observe(DRAFT, 2, 2, confidences=(0.9, 0.8))
    assert sum(ctl.calibrator.trials) == pytest.approx(trials + 2)  # two drafted prefixes observed
    assert ctl.lookup.alpha == lookup_alpha  # lookup keeps its evidence while the draft model drafts
    ctl.observe(DRAFT, 0, 0)
    assert ctl.lookup.alpha > lookup_alpha  # a plain step relaxes it towards its prior


def test_needs_two_drafters():
    with pytest.raises(ValueError, match="two drafters"):
        HybridConfidenceController(FLAT, COSTS[:1])


@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("drafter", ["other_seed", "noisy_copy", "same_model"])
def test_greedy_equals_plain(models, drafter):
    plain = models["target"].generate(PROMPT, max_new_tokens=40, do_sample=False)
    out = models["target"].generate(PROMPT, speculation="hybrid-confidence", assistant_model=models[drafter],
                                    speculation_costs=FLAT, max_new_tokens=40, do_sample=False,
                                    return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    steps = out.speculation.steps
    assert sum(s.emitted for s in steps) == 39 and all(0 <= s.accepted <= s.k <= 8 for s in steps)
    assert {s.drafter for s in steps} - {"plain"}  # something was drafted


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_both_drafters_are_used_and_sampling_runs(models):
    torch.manual_seed(0)
    out = models["target"].generate(PROMPT, speculation="hybrid-confidence", assistant_model=models["noisy_copy"],
                                    speculation_costs=FLAT, max_new_tokens=60, do_sample=True,
                                    return_dict_in_generate=True)
    assert out.sequences.shape == (1, PROMPT.shape[1] + 60)
    assert {"draft_model", "prompt_lookup"} <= {s.drafter for s in out.speculation.steps}
