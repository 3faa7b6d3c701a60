"""Where a request's α starts: the upper quartile of the pair's recent requests (of its prior until it
has some), and learned state kept per ``SpeculationState`` (the model's own, or one given per call)."""

from __future__ import annotations

import pytest
import torch

import hf_adaspec
from hf_adaspec import CostTable, SpeculationConfig
from hf_adaspec.policy.acceptance import AcceptanceMemory, AcceptancePrior, beta_quantile, nearest_rank
from hf_adaspec.policy.confidence import CalibratorMemory, ConfidenceCalibrator
from hf_adaspec.policy.controller import AdaptiveController, IIDAcceptance, StepView
from hf_adaspec.policy.modes import SPECULATION_MODES, Learned, PolicyInputs
from hf_adaspec.proposers.prompt_lookup import LOOKUP_START_ALPHA
from hf_adaspec.seam.integration import SpeculationState

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]
# a draft forward costs half a verification: k = 1 at α = 0.6 makes 1.6 tokens in 160 ms, no faster than plain
COSTS = CostTable(verify_ms=tuple(100.0 + 10 * i for i in range(9)), draft_ms=50.0)


def test_nearest_rank_by_hand():
    values = [0.3, 0.9, 0.5, 0.7]
    assert nearest_rank(values, 0.75) == 0.7  # ceil(0.75 · 4) = 3rd of 0.3, 0.5, 0.7, 0.9
    assert nearest_rank(values, 0.0) == 0.3 and nearest_rank(values, 1.0) == 0.9
    with pytest.raises(ValueError, match="at least one"):
        nearest_rank([], 0.5)


def test_beta_quantile_by_hand():
    assert beta_quantile(0.5, 2.0, 0.3) == pytest.approx(0.3, abs=1e-3)  # Beta(1, 1): uniform
    assert beta_quantile(2 / 3, 3.0, 0.49) == pytest.approx(0.7, abs=1e-3)  # Beta(2, 1): F(x) = x²
    assert beta_quantile(0.5, 4.0, 0.75) == pytest.approx(0.6736, abs=1e-3)  # Beta(2, 2): 3x² − 2x³ = 0.75
    assert beta_quantile(0.6, 4.0, 0.75) > 0.6 > beta_quantile(0.6, 4.0, 0.25)
    with pytest.raises(ValueError, match="quantile"):
        beta_quantile(0.6, 4.0, 1.5)
    with pytest.raises(ValueError, match="strength"):
        beta_quantile(0.6, 0.0, 0.5)


def test_memory_quantile_prior_from_recent_requests():
    memory = AcceptanceMemory(AcceptancePrior(mean=0.6), size=4, min_drafted=4, min_requests=3)
    memory.record("a", drafted=8, accepted=2)  # rate 0.25
    memory.record("a", drafted=3, accepted=3)  # under min_drafted: not kept
    memory.record("a", drafted=10, accepted=9)  # rate 0.9
    assert memory.prior_for("a").mean == pytest.approx(beta_quantile(0.6, 4.0, 0.75))  # 2 rates < min_requests
    assert memory.prior_for("a", start=0.37).mean == 0.37  # a drafter's own start rate
    memory.record("a", drafted=4, accepted=2)  # rate 0.5
    assert memory.prior_for("a").mean == pytest.approx(0.9)  # ceil(0.75 · 3) = 3rd of 0.25, 0.5, 0.9
    for _ in range(4):
        memory.record("a", drafted=10, accepted=1)
    assert memory.prior_for("a").mean == pytest.approx(0.1)  # only the last 4 requests count
    median = AcceptanceMemory(quantile=0.5, min_requests=3)
    for rate in (2, 5, 9):
        median.record("a", drafted=10, accepted=rate)
    assert median.prior_for("a").mean == pytest.approx(0.5)


def _first_k(prior: AcceptancePrior) -> int:
    """k of the first step of a paid drafter at ``prior``'s mean (α held there), 64 tokens to come."""
    ctl = AdaptiveController(lambda b: COSTS, [IIDAcceptance(1, prior)], [True])
    return ctl.decide(StepView(((8,),), (0,), horizon=64)).ks[0]


def test_a_quantile_prior_drafts_where_the_mean_would_lock_the_draft_out():
    """Two requests at 0.9 acceptance and a long one at 0.3: the drafted-weighted mean (0.34) says a
    draft does not pay at these costs, so the next request would never draft and never learn; the
    upper quartile (0.9) tries it."""
    memory = AcceptanceMemory(AcceptancePrior(mean=0.6))
    for drafted, accepted in ((10, 9), (10, 9), (100, 30)):
        memory.record("d", drafted, accepted)
    assert memory.prior_for("d").mean == pytest.approx(0.9)
    assert _first_k(AcceptancePrior(mean=(9 + 9 + 30) / 120)) == 0
    assert _first_k(memory.prior_for("d")) > 0


def test_a_new_pair_drafts_at_its_priors_upper_quartile_where_the_prior_mean_would_not():
    """No request recorded yet: at α = 0.6 a draft does not pay at these costs, so no request would
    draft and no rate would ever be recorded; the prior's 0.75 quantile (≈ 0.78) tries it."""
    memory = AcceptanceMemory(AcceptancePrior(mean=0.6))
    assert memory.prior_for("d").mean == pytest.approx(0.776, abs=0.01)
    assert _first_k(AcceptancePrior(mean=0.6)) == 0
    assert _first_k(memory.prior_for("d")) > 0


def _adaptive(memory: AcceptanceMemory, costs: CostTable):
    drafters = (("draft_model", "d"), ("prompt_lookup", "l"))
    inputs = PolicyInputs(SpeculationConfig("adaptive"), lambda b: costs, 1, drafters,
                          Learned(memory, CalibratorMemory()))
    return SPECULATION_MODES["adaptive"].build(inputs)


def test_adaptive_mode_starts_lookup_at_its_own_rate_and_the_draft_model_optimistically():
    cheap_draft = CostTable(verify_ms=(10.0,) * 9, draft_ms=0.5)
    decision = _adaptive(AcceptanceMemory(), cheap_draft).decide(StepView(((8,), (0,)), (0, 0), horizon=64))
    assert decision.drafters == (0,) and decision.ks == (8,) and decision.alphas[0] > 0.6
    dear_draft = CostTable(verify_ms=(10.0,) * 9, draft_ms=50.0)
    memory = AcceptanceMemory()
    decision = _adaptive(memory, dear_draft).decide(StepView(((8,), (8,)), (0, 0), horizon=64))
    assert decision.drafters == (1,) and decision.alphas == (LOOKUP_START_ALPHA,)
    for _ in range(3):  # lookup's own history replaces its start rate
        memory.record("l", drafted=10, accepted=9)
    decision = _adaptive(memory, dear_draft).decide(StepView(((8,), (8,)), (0, 0), horizon=64))
    assert decision.alphas == (pytest.approx(0.9),)


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_a_given_speculation_state_learns_instead_of_the_models_own(tiny_factory):
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(0)
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
    made = []  # the calibrators the given state creates
    own = SpeculationState()
    given = SpeculationState(calibrators=CalibratorMemory(lambda: made.append(ConfidenceCalibrator()) or made[-1]))

    def run(**kwargs):
        return hf_adaspec.seam.integration._speculative_entry(
            target.generate.__wrapped__, own, speculation="adaptive", inputs=PROMPT, assistant_model=draft,
            speculation_costs=costs, max_new_tokens=12, do_sample=False, return_dict_in_generate=True, **kwargs)

    run()
    assert own.lengths.horizon(1, 100) == 11 and given.lengths.horizon(1, 100) == 1  # 12 tokens ran, 1 so far
    out = run(speculation_state=given)
    assert given.lengths.horizon(1, 100) == 11 and len(own.lengths.lengths) == 1
    drafted = sum(s.k for s in out.speculation.steps if s.drafter == "draft_model")
    assert drafted > 0 and len(made) == 1 and made[0].tokens_seen == drafted  # the calibration learned there too


def test_a_speculation_state_without_speculation_names_the_fix(models):
    with pytest.raises(ValueError, match="speculation="):
        models["target"].generate(PROMPT, max_new_tokens=2, speculation_state=SpeculationState())
