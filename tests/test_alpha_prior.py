"""Where a request's α starts: a quantile of the pair's recent requests, and learned state kept per
``SpeculationState`` (the model's own, or one given per call, as the bench gives each method)."""

from __future__ import annotations

import pytest
import torch

import hf_adaspec
from hf_adaspec import CostTable
from hf_adaspec.acceptance import AcceptanceMemory, AcceptancePrior, beta_quantile, nearest_rank
from hf_adaspec.controller import DraftOption, DrafterCosts, GoodputController
from hf_adaspec.integration import SpeculationState

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]


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
    memory.record("a", drafted=3, accepted=3)  # under min_drafted: the running mean only
    memory.record("a", drafted=10, accepted=9)  # rate 0.9
    assert memory.prior_for("a", 0.75).mean == pytest.approx(beta_quantile(0.6, 4.0, 0.75))  # 2 rates < min_requests
    assert memory.prior_for("a", 0.75, start=0.37).mean == 0.37  # a drafter's own start rate
    memory.record("a", drafted=4, accepted=2)  # rate 0.5
    assert memory.prior_for("a", 0.75).mean == pytest.approx(0.9)  # ceil(2.25) = 3rd of 0.25, 0.5, 0.9
    assert memory.prior_for("a", 0.5).mean == pytest.approx(0.5)
    assert memory.prior_for("a").mean == pytest.approx(0.6724, abs=1e-4)  # running mean: 0.425, 0.582, 0.759, 0.672
    for _ in range(4):
        memory.record("a", drafted=10, accepted=1)
    assert memory.prior_for("a", 0.75).mean == pytest.approx(0.1)  # only the last 4 requests count
    for _ in range(3):
        memory.record("b", drafted=10, accepted=10)
    assert memory.prior_for("b", 1.0).mean == 0.95  # clamped, so the prior stays valid
    with pytest.raises(ValueError, match="quantile"):
        memory.prior_for("a", 1.5)
    with pytest.raises(ValueError, match="min_requests"):
        AcceptanceMemory(min_requests=0)


def test_a_quantile_prior_drafts_where_the_running_mean_would_lock_the_draft_out():
    """Two requests at 0.9 acceptance and a long one at 0.3: the drafted-weighted mean (0.34) says a
    draft does not pay at these costs (break-even α ≈ 0.65 for k = 1), so the next request would never
    draft and never learn; the upper quartile (0.9) tries it."""
    memory = AcceptanceMemory(AcceptancePrior(mean=0.6))
    for drafted, accepted in ((10, 9), (10, 9), (100, 30)):
        memory.record("d", drafted, accepted)
    costs = CostTable(verify_ms=tuple(100.0 + 10 * i for i in range(9)), draft_ms=50.0)

    def first_k(quantile):
        controller = GoodputController(costs, [DrafterCosts(50.0)], [memory.prior_for("d", quantile)])
        return controller.choose([DraftOption(0, 8)], horizon=64).k

    assert memory.prior_for("d").mean == pytest.approx(0.34, abs=0.01)
    assert first_k(None) == 0
    assert first_k(0.75) > 0


def test_a_new_pair_drafts_at_its_priors_upper_quantile_where_the_prior_mean_would_not():
    """No request recorded yet: at α = 0.6 a draft does not pay at these costs (k = 1: 1.6 tokens in
    160 ms, as fast as a plain step), so no request would draft and no rate would ever be recorded;
    the prior's 0.75 quantile (≈ 0.78) tries it."""
    memory = AcceptanceMemory(AcceptancePrior(mean=0.6))
    costs = CostTable(verify_ms=tuple(100.0 + 10 * i for i in range(9)), draft_ms=50.0)

    def first_k(quantile):
        controller = GoodputController(costs, [DrafterCosts(50.0)], [memory.prior_for("d", quantile)])
        return controller.choose([DraftOption(0, 8)], horizon=64).k

    assert memory.prior_for("d", 0.75).mean == pytest.approx(0.776, abs=0.01)
    assert first_k(None) == 0
    assert first_k(0.75) > 0


def test_config_rejects_a_quantile_outside_zero_one():
    with pytest.raises(ValueError, match="alpha_prior_quantile"):
        hf_adaspec.SpeculationConfig("adaptive", alpha_prior_quantile=-0.1)


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_a_given_speculation_state_learns_instead_of_the_models_own(tiny_factory):
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(0)
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
    own, given = SpeculationState(), SpeculationState()

    def run(state, **kwargs):
        return hf_adaspec.integration._speculative_entry(
            target.generate.__wrapped__, own, speculation="adaptive", inputs=PROMPT, assistant_model=draft,
            speculation_costs=costs, max_new_tokens=12, do_sample=False, **kwargs)

    run(own)
    assert own.lengths.horizon(1, 100) == 11 and given.lengths.horizon(1, 100) == 1  # 12 tokens ran, 1 so far
    run(own, speculation_state=given)
    assert given.lengths.horizon(1, 100) == 11
    assert given.memory.prior_for(next(iter(given.memory._mean))).mean > 0.6  # α = 1 learned there


def test_a_speculation_state_without_speculation_names_the_fix(models):
    with pytest.raises(ValueError, match="speculation="):
        models["target"].generate(PROMPT, max_new_tokens=2, speculation_state=SpeculationState())


def test_only_the_draft_model_starts_a_new_pair_optimistically(tiny_factory):
    from transformers import LogitsProcessorList

    from hf_adaspec.integration import SpeculationRequest
    from hf_adaspec.modes import drafter_priors
    from hf_adaspec.proposers import DraftModelProposer, PromptLookupProposer
    from hf_adaspec.proposers.prompt_lookup import LOOKUP_START_ALPHA

    proposers = [DraftModelProposer(tiny_factory(0), LogitsProcessorList(), False), PromptLookupProposer()]
    request = SpeculationRequest(hf_adaspec.SpeculationConfig("hybrid"), memory=AcceptanceMemory())
    draft, lookup = drafter_priors(request, proposers)
    assert draft.mean == pytest.approx(beta_quantile(0.6, 4.0, 0.75)) and lookup.mean == LOOKUP_START_ALPHA < 0.6
