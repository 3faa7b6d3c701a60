"""GoodputController: (drafter, k) choice by predicted goodput, incl. hybrid drafting and k = 0."""

import pytest

from hf_adaspec.acceptance import AcceptancePrior
from hf_adaspec.controller import DraftOption, DrafterCosts, FixedController, GoodputController
from hf_adaspec.costs import CostTable

FLAT = CostTable(verify_ms=(50.0,) * 9, draft_ms=20.0)  # verification costs the same for 1..9 tokens
DRAFT, LOOKUP = DrafterCosts(draft_ms=20.0, catchup_ms=2.0), DrafterCosts()


def _controller(alpha_draft: float, alpha_lookup: float, min_gain: float = 0.0) -> GoodputController:
    priors = [AcceptancePrior(alpha_draft, 1e6), AcceptancePrior(alpha_lookup, 1e6)]  # strong: α fixed
    return GoodputController(FLAT, [DRAFT, LOOKUP], priors, min_gain)


def test_hybrid_picks_free_lookup_when_it_offers_tokens():
    decision = _controller(0.8, 0.8).choose([DraftOption(0, 8), DraftOption(1, 5)], horizon=64)
    assert (decision.drafter, decision.k) == (1, 5)  # free drafts, flat verification: take all it offers


def test_hybrid_picks_draft_model_when_lookup_has_no_match():
    decision = _controller(0.8, 0.8).choose([DraftOption(0, 8), DraftOption(1, 0)], horizon=64)
    assert decision.drafter == 0 and decision.k > 0


def test_hybrid_prefers_draft_when_lookup_acceptance_is_poor():
    decision = _controller(0.95, 0.05).choose([DraftOption(0, 8), DraftOption(1, 8)], horizon=64)
    assert decision.drafter == 0 and decision.k >= 3


def test_plain_step_when_nothing_pays():
    decision = _controller(0.1, 0.01, min_gain=0.03).choose([DraftOption(0, 8), DraftOption(1, 8)], horizon=64)
    assert decision.k == 0
    assert decision.predicted_goodput == pytest.approx(1000.0 / 50.0)


def test_catchup_cost_keeps_a_short_answer_on_plain_steps():
    ctl = _controller(0.8, 0.01, min_gain=0.0)
    assert ctl.choose([DraftOption(0, 8, catchup_tokens=0)], horizon=8).k > 0
    assert ctl.choose([DraftOption(0, 8, catchup_tokens=2000)], horizon=8).k == 0  # 4 s ingest for 8 tokens


def test_observe_updates_only_the_used_drafter_and_relaxes_the_other():
    ctl = GoodputController(FLAT, [DRAFT, LOOKUP], [AcceptancePrior(0.5, 2.0, 0.5)] * 2)
    ctl.observe(0, drafted=4, accepted=4)
    ctl.observe(1, drafted=3, accepted=0)
    high, low = ctl.estimators[0].alpha, ctl.estimators[1].alpha
    assert high > 0.5 > low
    for _ in range(20):
        ctl.observe(0, drafted=0, accepted=0)  # plain steps: both relax towards the prior mean
    assert ctl.estimators[0].alpha == pytest.approx(0.5, abs=1e-3)
    assert ctl.estimators[1].alpha == pytest.approx(0.5, abs=1e-3)


def test_fixed_controller_caps_k_by_offer():
    ctl = FixedController(5, FLAT, draft_ms=20.0)
    assert ctl.choose([DraftOption(0, 3)]).k == 3
    assert ctl.choose([DraftOption(0, 8)]).k == 5
