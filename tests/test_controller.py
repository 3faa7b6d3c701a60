"""The Controller contract: AdaptiveController.decide(batch, view) → a Decision that carries its pricing and
stop rules / observe(decision, outcome) / select over one or more rows, and FixedController (with and without
p_min)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import decide

from hf_adaspec.costs.table import CostTable
from hf_adaspec.policy.acceptance import AcceptancePrior, ConfidenceAcceptance, IIDAcceptance
from hf_adaspec.policy.confidence import ConfidenceCalibrator
from hf_adaspec.policy.controller import AdaptiveController, FixedController, StepView
from hf_adaspec.policy.decision import ConfidenceStop, Decision, Pricing, StepOutcome, step_ms
from hf_adaspec.policy.goodput import DrafterPaths, best_plan, expected_tokens

# verification costs the same for 1..9 tokens; 20 ms per draft token, 2 ms per catch-up token
FLAT = CostTable(verify_ms=(50.0,) * 9, draft_ms=20.0, draft_catchup_ms=2.0)
FAST = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # 1 ms drafts, 10 ms verification


def _iid(alpha: float, batch: int = 1, strength: float = 1e6) -> IIDAcceptance:
    return IIDAcceptance(batch, AcceptancePrior(alpha, strength))  # strong prior: α fixed


def _hybrid(alpha_draft: float, alpha_lookup: float, min_gain: float = 0.0) -> AdaptiveController:
    """Drafter 0: a paid draft model with i.i.d. α; drafter 1: free prompt lookup."""
    return AdaptiveController(lambda b: FLAT, [_iid(alpha_draft), _iid(alpha_lookup)], [True, False], min_gain)


def _view(draft: int, lookup: int, catchup: int = 0, horizon: int = 64) -> StepView:
    return StepView(((draft,), (lookup,)), (catchup, 0), horizon)


def _outcome(drafter: int, k: int, accepted: int, confidences: tuple[float, ...] = ()) -> StepOutcome:
    return StepOutcome((drafter,), (k,), (accepted,), (confidences,))


def _confident(token_mean: float, batch: int = 1, costs: CostTable = FAST, **kwargs) -> AdaptiveController:
    """One confidence-stopped draft model, identity calibration (P = c on [0.05, 0.95]), c̄ = token_mean."""
    model = ConfidenceAcceptance(batch, ConfidenceCalibrator(token_mean=token_mean, optimism=0.0))
    return AdaptiveController(lambda b: costs, [model], [True], **kwargs)


# --- decide ---------------------------------------------------------------------------------


def test_hybrid_picks_free_lookup_when_it_offers_tokens():
    decision = decide(_hybrid(0.8, 0.8), _view(8, 5))
    assert (decision.drafters, decision.ks) == ((1,), (5,))  # free drafts, flat verification: all it offers
    assert decision.alphas == (pytest.approx(0.8),)


def test_hybrid_picks_draft_model_when_lookup_has_no_match():
    decision = decide(_hybrid(0.8, 0.8), _view(8, 0))
    assert decision.drafters == (0,) and decision.ks[0] > 0


def test_hybrid_prefers_draft_when_lookup_acceptance_is_poor():
    decision = decide(_hybrid(0.95, 0.05), _view(8, 8))
    assert decision.drafters == (0,) and decision.ks[0] >= 3


def test_plain_step_when_nothing_pays():
    decision = decide(_hybrid(0.1, 0.01, min_gain=0.03), _view(8, 8))
    assert decision.ks == (0,)
    assert decision.predicted_goodput == pytest.approx(1000.0 / 50.0)


def test_catchup_keeps_a_short_answer_on_plain_steps():
    ctl = _hybrid(0.8, 0.01)
    assert decide(ctl, _view(8, 0, catchup=0, horizon=8)).ks[0] > 0
    assert decide(ctl, _view(8, 0, catchup=2000, horizon=8)).ks == (0,)  # 4 s ingest for 8 tokens
    assert decide(ctl, _view(8, 0, catchup=2000, horizon=10**6)).ks[0] > 0  # amortised over a long run


def test_costs_are_asked_at_the_current_batch_size():
    seen = []

    def costs_for(b: int) -> CostTable:
        seen.append(b)
        return FAST

    ctl = AdaptiveController(costs_for, [_iid(0.8, batch=3)], [True])
    assert len(decide(ctl, StepView(((8, 8, 8),), (0,))).ks) == 3
    ctl.select(torch.tensor([0, 2]))
    assert len(decide(ctl, StepView(((8, 8),), (0,))).ks) == 2
    assert seen == [3, 2]


def test_a_confidence_stopped_row_gets_its_whole_offer_a_lookup_row_min_of_k_and_its_offer():
    rising = CostTable(verify_ms=tuple(10.0 + 2.0 * n for n in range(1, 10)), draft_ms=1.0)
    draft = ConfidenceAcceptance(3, ConfidenceCalibrator(token_mean=0.9, optimism=0.0))
    lookup = _iid(0.95, batch=3)
    ctl = AdaptiveController(lambda b: rising, [draft, lookup], [True, False])
    # row 0: no n-gram match; row 1: a long one; row 2: a budget of 2 tokens left
    view = StepView(((6, 6, 2), (0, 8, 2)), (0, 0), horizon=64)
    plan = best_plan(
        [
            DrafterPaths(tuple(draft.path(i, u) for i, u in enumerate(view.bounds[0])), 1.0),
            DrafterPaths(tuple(lookup.path(i, u) for i, u in enumerate(view.bounds[1]))),
        ],
        rising.t_verify,
        64,
        ctl.min_gain,
    )
    assert 2 < plan.k < 6 and plan.drafters == (0, 1, 1)  # the test needs a k between the offers
    decision = decide(ctl, view)
    assert decision.drafters == plan.drafters
    assert decision.ks == (6, plan.k, 2)  # the stop rule ends row 0; lookup rows take min(k, u_i)
    assert decision.predicted_goodput == pytest.approx(plan.goodput)


# --- observe and select ---------------------------------------------------------------------


def test_observe_teaches_the_used_drafter_and_a_plain_step_relaxes_every_iid_model():
    draft, lookup = IIDAcceptance(1, AcceptancePrior(0.5, 2.0, 0.5)), IIDAcceptance(1, AcceptancePrior(0.5, 2.0, 0.5))
    ctl = AdaptiveController(lambda b: FLAT, [draft, lookup], [True, False])
    ctl.observe(Decision.plain(1), _outcome(0, 4, 4))
    assert draft.alpha(0) > 0.5 and lookup.alpha(0) == 0.5  # only the drafter that drafted learns
    ctl.observe(Decision.plain(1), _outcome(1, 3, 0))
    high, low = draft.alpha(0), lookup.alpha(0)
    assert low < 0.5 and draft.alpha(0) == high  # the draft model keeps its evidence while lookup drafts
    ctl.observe(Decision.plain(1), _outcome(0, 0, 0))  # a plain step: both relax towards the prior mean
    assert 0.5 < draft.alpha(0) < high and low < lookup.alpha(0) < 0.5
    for _ in range(20):
        ctl.observe(Decision.plain(1), _outcome(0, 0, 0))
    assert draft.alpha(0) == pytest.approx(0.5, abs=1e-3) and lookup.alpha(0) == pytest.approx(0.5, abs=1e-3)


def test_select_keeps_the_rows_own_acceptance():
    ctl = AdaptiveController(lambda b: FAST, [IIDAcceptance(3)], [True], min_gain=0.0)
    first = decide(ctl, StepView(((8, 8, 8),), (0,)))
    assert len(set(first.ks)) == 1 and first.ks[0] > 0  # one k for the batch
    for _ in range(10):
        ctl.observe(first, StepOutcome((0, 0, 0), (4, 4, 4), (4, 0, 2), ((), (), ())))  # row 1 never accepts
    before = decide(ctl, StepView(((8, 8, 8),), (0,))).alphas
    assert before[1] < 0.3 < before[2] < 0.8 < before[0]
    ctl.select(torch.tensor([2, 1]))  # row 0 finished; the others keep their α, in the new order
    after = decide(ctl, StepView(((8, 2),), (0,)))
    assert after.alphas == pytest.approx((before[2], before[1])) and after.ks[1] <= 2


def test_select_keeps_each_rows_mean_confidence():
    ctl = _confident(0.5, batch=3)
    ctl.observe(Decision.plain(3), StepOutcome((0, 0, 0), (2, 2, 0), (2, 0, 0), ((0.95, 0.95), (0.1, 0.1), ())))
    before = decide(ctl, StepView(((4, 4, 4),), (0,))).alphas
    assert before[1] < before[2] < before[0]
    assert before[2] == pytest.approx(0.5)  # row 2 kept the seed: a plain step teaches nothing
    ctl.select(torch.tensor([1, 0]))
    assert decide(ctl, StepView(((4, 4),), (0,))).alphas == pytest.approx((before[1], before[0]))


# --- the confidence stop rule ---------------------------------------------------------------


def test_stop_rule_stops_when_the_next_columns_predicted_probability_is_low():
    ctl = _confident(0.9)
    stop = decide(ctl, StepView(((8,),), (0,))).stop(0)
    assert not stop(1, [(0.9,)], [True])  # ĉ_2 = 0.81 ≫ 1.9/11: keep drafting
    assert stop(1, [(0.1,)], [True])  # P_1 = 0.1, ĉ_2 = 0.09 < 1.1/11 = 0.1: stop
    assert not stop(1, [(0.2,)], [True])  # P_1 = 0.2, ĉ_2 = 0.18 > 1.2/11: keep drafting
    assert stop(3, [(0.9, 0.3, 0.3)], [True])  # real c_3 = 0.081 (not c̄^3 = 0.73): ĉ_4 = 0.073 does not pay
    assert stop(1, [(0.9,)], [False])  # the row cannot take another token


def test_stop_rule_over_a_batch_drafts_on_while_one_row_pays():
    ctl = _confident(0.9, batch=2)
    stop = decide(ctl, StepView(((8, 8),), (0,))).stop(0)
    assert stop(1, [(0.1,), (0.1,)], [True, True])
    assert not stop(1, [(0.1,), (0.9,)], [True, True])
    # each row its own next probability: 0.135 + 0.05 < 2.2 tokens / 11 ms, though twice the larger is not
    assert stop(1, [(0.15,), (0.01,)], [True, True])
    assert stop(1, [(0.1,), (0.9,)], [True, False])  # the confident row is done


def test_only_confidence_stopped_drafters_have_a_stop_rule():
    ctl = AdaptiveController(
        lambda b: FAST, [ConfidenceAcceptance(1, ConfidenceCalibrator()), _iid(0.5)], [True, False]
    )
    decision = decide(ctl, _view(8, 8))
    assert isinstance(decision.stop(0), ConfidenceStop) and decision.stop(1) is None


# --- FixedController ------------------------------------------------------------------------


def test_fixed_controller_caps_k_by_each_rows_offer():
    decision = decide(FixedController(3, batch=3), StepView(((8, 1, 0), (5, 5, 5)), (0, 0)))
    assert decision.ks == (3, 1, 0) and decision.drafters == (0, 0, 0)  # always the first drafter
    assert math.isnan(decision.predicted_goodput)  # no costs: nothing predicted
    with pytest.raises(ValueError, match=">= 0"):
        FixedController(-1)


def test_fixed_controller_predicts_the_goodput_of_its_k_from_each_rows_alpha():
    costs = CostTable(verify_ms=tuple(10.0 + i for i in range(9)), draft_ms=2.0)
    ctl = FixedController(4, costs_for=lambda b: costs, batch=2)
    first = decide(ctl, StepView(((4, 2),), (0,)))
    assert first.alphas == pytest.approx((0.6, 0.6))  # the estimator's prior mean
    expected = expected_tokens(0.6, 4) + expected_tokens(0.6, 2)
    assert first.predicted_goodput == pytest.approx(1000.0 * expected / (4 * 2.0 + 14.0))  # width 4 for both rows
    ctl.observe(first, StepOutcome((0, 0), (4, 2), (4, 0), ((), ())))
    after = decide(ctl, StepView(((4, 2),), (0,)))
    assert after.alphas[0] > 0.6 > after.alphas[1]  # each row learns its own α
    free = decide(FixedController(4, costs_for=lambda b: costs, paid=False), StepView(((4,),), (0,)))
    assert free.predicted_goodput == pytest.approx(1000.0 * expected_tokens(0.6, 4) / 14.0)  # lookup drafts free


def test_fixed_controller_without_p_min_never_stops():
    decision = decide(FixedController(4), StepView(((4,),), (0,)))
    assert decision.stop(0) is None and decision.stops == ()


def test_fixed_controller_p_min_stops_once_every_growing_row_is_unsure():
    stop = decide(FixedController(8, p_min=0.75), StepView(((8,),), (0,))).stop(0)
    assert not stop(1, [(0.8,)], [True])
    assert stop(2, [(0.8, 0.7)], [True])
    assert not stop(2, [(0.8, 0.75)], [True])  # strictly below p_min stops
    assert not stop(1, [(0.5,), (0.9,)], [True, True])  # row 1 is still sure
    assert stop(1, [(0.5,), (0.9,)], [True, False])  # ... but takes no more tokens


# --- price: the predicted time of the step as it ran ------------------------------------------------


def test_step_ms_prices_the_step_as_it_ran():
    table = CostTable(verify_ms=(50.0, 52.0, 54.0, 56.0, 58.0), draft_ms=10.0, draft_catchup_ms=2.0)
    outcome = StepOutcome((0, 1), (3, 4), (1, 2), ((), ()))  # row 0: paid drafter, 3 tokens; row 1: free, 4
    assert step_ms(table, (True, False), (4, 0), outcome) == (3 * 10.0 + 4 * 2.0, 58.0)
    assert step_ms(table, (True, False), (4, 0), StepOutcome((0,), (0,), (0,), ((),))) == (0.0, 50.0)


def test_a_decision_prices_its_step_by_its_own_costs_and_catchup():
    adaptive, fixed = _hybrid(0.8, 0.8), FixedController(3, costs_for=lambda b: FLAT)
    outcome = StepOutcome((0,), (3,), (1,), ((),))
    decided = decide(adaptive, _view(8, 0, catchup=5))
    later = decide(adaptive, _view(8, 0, catchup=0))  # a later decision does not change the earlier one's price
    assert decided.pricing == Pricing(FLAT, (True, False), (5, 0))
    assert decided.price(outcome) == pytest.approx(3 * 20.0 + 5 * 2.0 + 50.0)
    assert later.price(outcome) == pytest.approx(3 * 20.0 + 50.0)
    assert decide(fixed, StepView(((5,),), (0,), 8)).price(outcome) == pytest.approx(3 * 20.0 + 50.0)
    assert math.isnan(decide(FixedController(3), StepView(((5,),), (0,))).price(outcome))  # no cost model
    assert math.isnan(Decision.plain(1).price(outcome))


def test_a_stop_rule_keeps_the_costs_it_was_decided_with():
    costs = {1: FAST}
    ctl = _confident(0.9, costs=FAST)
    ctl.costs_for = lambda b: costs[1]
    stop = decide(ctl, StepView(((8,),), (0,))).stop(0)
    costs[1] = CostTable(verify_ms=(10.0,) * 9, draft_ms=100.0)  # the next decision's drafts would not pay
    assert not stop(1, [(0.9,)], [True]) and decide(ctl, StepView(((8,),), (0,))).stop(0)(1, [(0.9,)], [True])


def test_a_rest_is_decided_without_the_view_and_priced_as_the_decision_that_began_it():
    ctl = AdaptiveController(lambda b: FLAT, [_iid(0.01)], [True])
    plain = StepOutcome((0,), (0,), (0,), ((),), decision_ms=10.0)  # deciding costs 20% of a 50 ms step
    for _ in range(3):  # the third plain decision in a row, with most of the timing window in, begins a rest
        observed = decide(ctl, StepView(((8,),), (0,)))
        assert not observed.rested and observed.ks == (0,)
        ctl.observe(observed, plain)

    def no_view():
        raise AssertionError("a rest builds no view")

    rested = ctl.decide(1, no_view)
    assert rested.rested and rested.ks == (0,) and rested.pricing == observed.pricing
    assert rested.price(_outcome(0, 0, 0)) == pytest.approx(50.0)
