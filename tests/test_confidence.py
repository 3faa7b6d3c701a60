"""Confidence-priced drafting (AdaSpec): PAV, calibration, the stop rule draft_next_column, the draft
model priced by its calibrated confidence, and speculation="adaptive" / "fixed" + draft_p_min end to
end on tiny random Llamas."""

from __future__ import annotations

import math
import random

import pytest
import torch
from conftest import decide, slow_except
from transformers import LogitsProcessorList

from hf_adaspec import SpeculationConfig, SpeculationState
from hf_adaspec.backend.ragged import RaggedCache
from hf_adaspec.costs.table import CostTable
from hf_adaspec.policy.acceptance import ConfidenceAcceptance
from hf_adaspec.policy.confidence import (
    CalibratorMemory,
    ConfidenceCalibrator,
    isotonic,
    prefix_confidences,
)
from hf_adaspec.policy.controller import AdaptiveController, StepView
from hf_adaspec.policy.decision import Decision, StepOutcome
from hf_adaspec.policy.goodput import draft_next_column
from hf_adaspec.proposers import DraftModelProposer, Rows

FLAT = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # verification costs 10 ms for 1..9 tokens
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]


# --- pure functions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values, weights, expected",
    [
        ([1, 2, 3], [1, 1, 1], (1, 2, 3)),
        ([3, 1], [1, 1], (2, 2)),
        ([1, 3, 2, 4], [1, 1, 1, 1], (1, 2.5, 2.5, 4)),
        ([4, 3, 2, 1], [1, 1, 1, 1], (2.5, 2.5, 2.5, 2.5)),
        ([0.9, 0.1], [3, 1], (0.7, 0.7)),
        ([0.0, 1.0, 0.0, 1.0], [1, 1, 2, 1], (0.0, 1 / 3, 1 / 3, 1.0)),
        ([], [], ()),
    ],
)
def test_isotonic_pool_adjacent_violators(values, weights, expected):
    assert isotonic(values, weights) == pytest.approx(expected)


@pytest.mark.parametrize("values, weights", [([1, 2], [1]), ([1, 2], [1, 0]), ([1], [float("nan")])])
def test_isotonic_rejects_bad_weights(values, weights):
    with pytest.raises(ValueError):
        isotonic(values, weights)


def test_prefix_confidences_are_running_products():
    assert prefix_confidences((1.0, 0.8, 0.5)) == pytest.approx((1.0, 0.8, 0.4))
    assert prefix_confidences(()) == ()


# --- calibrator -------------------------------------------------------------------------------


def test_calibrator_starts_at_identity():
    cal = ConfidenceCalibrator(n_bins=10, optimism=0.0)
    for c in (0.05, 0.3, 0.62, 0.95):
        assert cal.predict(c) == pytest.approx(c)
    assert cal.predict(0.0) == pytest.approx(0.05) and cal.predict(1.0) == pytest.approx(0.95)
    with pytest.raises(ValueError):
        cal.predict(1.2)


def test_calibrator_prefix_update_semantics():
    cal = ConfidenceCalibrator(n_bins=2, prior_strength=1.0, token_mean=0.7, optimism=0.0)
    cal.update((1.0, 0.8, 0.5), accepted=1)  # c = 1.0, 0.8 (bin 1), 0.4 (bin 0); prefix 1 accepted only
    assert cal.trials == [2.0, 3.0]
    assert cal.successes == pytest.approx([0.25, 0.75 + 1.0])  # j=1 success; j=2, 3 failures
    assert cal.predict(0.25) == pytest.approx(0.125) and cal.predict(0.75) == pytest.approx(1.75 / 3)
    assert cal.token_mean == pytest.approx((0.7 + 1.0 + 0.8 + 0.5) / 4)  # the seed counts as one token
    cal.update((0.9, 0.9), accepted=2)  # c = 0.9, 0.81: both prefixes accepted
    assert cal.trials == [2.0, 5.0] and cal.successes[1] == pytest.approx(3.75)
    with pytest.raises(ValueError):
        cal.update((0.9,), accepted=2)


# the fast suite keeps test_calibrator_prefix_update_semantics and the optimism test's monotone grid
@pytest.mark.slow  # 20000 updates
def test_calibrator_learns_a_known_mapping_and_stays_monotone():
    truth = lambda c: c**2  # noqa: E731 — the draft is over-confident
    rng, cal = random.Random(0), ConfidenceCalibrator(n_bins=10, optimism=0.0)
    for _ in range(20000):
        c = rng.random()
        cal.update((c,), accepted=int(rng.random() < truth(c)))
    for c in (0.15, 0.35, 0.55, 0.75, 0.95):
        assert cal.predict(c) == pytest.approx(truth(c), abs=0.03)
    grid = [cal.predict(i / 100) for i in range(101)]
    assert all(a <= b for a, b in zip(grid, grid[1:]))


# the fast suite keeps test_calibrator_optimism_is_an_upper_bound_that_shrinks_with_observations (pooled, monotone)
@pytest.mark.slow  # 5000 updates
def test_calibrator_is_monotone_even_when_the_data_is_not():
    rng, cal = random.Random(1), ConfidenceCalibrator(n_bins=10)
    for _ in range(5000):
        c = rng.random()
        cal.update((c,), accepted=int(rng.random() < (0.9 if c < 0.5 else 0.2)))  # decreasing truth
    grid = [cal.predict(i / 100) for i in range(101)]
    assert all(a <= b for a, b in zip(grid, grid[1:]))
    assert max(grid) - min(grid) < 0.05  # PAV pools everything into (nearly) one level


def test_calibrator_memory_keeps_one_calibrator_per_key():
    memory = CalibratorMemory()
    assert memory.calibrator_for("a") is memory.calibrator_for("a")
    assert memory.calibrator_for("a") is not memory.calibrator_for("b")


def test_calibrator_optimism_is_an_upper_bound_that_shrinks_with_observations():
    cal = ConfidenceCalibrator(n_bins=10, prior_strength=2.0, optimism=1.0)
    assert cal.predict(0.65) == pytest.approx(0.65 + math.sqrt(0.65 * 0.35 / 3))  # 2 pseudo-trials
    for i in range(1000):  # bin 6 observed at rate 0.3
        cal.update((0.65,), accepted=int(i % 10 < 3))
    # the rarely seen bins 3-5 (P = 0.35-0.55 > 0.3) pool with it; their large bonus barely moves it
    assert cal.predict(0.65) == pytest.approx(0.3 + math.sqrt(0.3 * 0.7 / 1003), abs=0.01)
    grid = [cal.predict(i / 100) for i in range(101)]
    assert all(a <= b for a, b in zip(grid, grid[1:])) and max(grid) <= 1.0
    with pytest.raises(ValueError):
        ConfidenceCalibrator(optimism=-1.0)


# --- the draft model priced by its confidence -------------------------------------------------


def _draft_only(calibrator: ConfidenceCalibrator, costs: CostTable = FLAT) -> AdaptiveController:
    return AdaptiveController(lambda b: costs, [ConfidenceAcceptance(1, calibrator)], [True])


def _ks(ctl: AdaptiveController, offer: int, catchup: int = 0, horizon: int = 64) -> tuple[int, ...]:
    return decide(ctl, StepView(((offer,),), (catchup,), horizon)).ks


def test_cold_start_drafts_to_learn_then_stops_when_drafts_fail():
    # verify 10 ms/step, draft 3 ms/token: at P = c̄ = 0.15, k=1 predicts 1.15/13 < 1/10, so the mean
    # calibration never drafts and, observing nothing, never learns; the optimistic one tries
    slow = CostTable(verify_ms=(10.0,) * 9, draft_ms=3.0)
    assert _ks(_draft_only(ConfidenceCalibrator(token_mean=0.15, optimism=0.0), slow), 4) == (0,)
    ctl = _draft_only(ConfidenceCalibrator(token_mean=0.15, optimism=2.0), slow)
    assert _ks(ctl, 4) == (4,)
    for _ in range(200):  # every draft at this confidence is rejected
        ctl.observe(Decision.plain(1), StepOutcome((0,), (1,), (0,), ((0.15,),)))
    assert _ks(ctl, 4) == (0,)


def test_plain_or_the_whole_offer():
    assert _ks(_draft_only(ConfidenceCalibrator(token_mean=0.9, optimism=0.0)), 6) == (6,)
    assert _ks(_draft_only(ConfidenceCalibrator(token_mean=0.06, optimism=0.0)), 6) == (0,)  # P ≈ 0.06 < 0.1
    behind = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0, draft_catchup_ms=1.0)
    ctl = _draft_only(ConfidenceCalibrator(token_mean=0.9, optimism=0.0), behind)
    assert _ks(ctl, 6, catchup=2000, horizon=8) == (0,)  # a 2 s catch-up for 8 tokens


def test_catchup_is_amortised_over_the_whole_predicted_run():
    """A 60 ms catch-up over a 12-token horizon: one draft token does not pay it, six do."""
    behind = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0, draft_catchup_ms=1.0)
    ctl = _draft_only(ConfidenceCalibrator(token_mean=0.9, optimism=0.0), behind)
    assert _ks(ctl, 1, catchup=60, horizon=12) == (0,)
    assert _ks(ctl, 6, catchup=60, horizon=12) == (6,)


def test_observe_corrects_the_calibration_and_the_rows_mean_confidence():
    cal = ConfidenceCalibrator(token_mean=0.5)
    ctl = _draft_only(cal)
    start = decide(ctl, StepView(((4,),), (0,))).alphas[0]
    ctl.observe(Decision.plain(1), StepOutcome((0,), (2,), (2,), ((0.9, 0.9),)))
    assert sum(cal.trials) == pytest.approx(10 * 2.0 + 2)  # one trial per drafted prefix
    risen = decide(ctl, StepView(((4,),), (0,))).alphas[0]
    assert risen > start  # c̄ rose to (4·0.5 + 0.9 + 0.9) / 6
    ctl.observe(Decision.plain(1), StepOutcome((0,), (0,), (0,), ((),)))  # a plain step leaves both alone
    assert sum(cal.trials) == pytest.approx(22.0) and decide(ctl, StepView(((4,),), (0,))).alphas[0] == risen


# --- the stop rule ----------------------------------------------------------------------------


def test_draft_next_column_stops_exactly_when_goodput_would_fall():
    # j=1 with P_1 = 0.9: goodput(1) = 1.9 / 11 ms; goodput(2) = (1.9 + p) / 12 ms rises iff p > 1.9/11
    threshold = 1.9 / 11
    assert draft_next_column([[0.9]], [threshold + 1e-6], 1.0, FLAT.t_verify)
    assert not draft_next_column([[0.9]], [threshold - 1e-6], 1.0, FLAT.t_verify)
    assert not draft_next_column([[0.5]], [0.0], 0.0, FLAT.t_verify)  # free drafts, flat verify: a tie stops
    assert draft_next_column([[0.5]], [0.01], 0.0, FLAT.t_verify)


def test_the_first_column_must_beat_a_plain_step():
    # plain: 1 token / 10 ms; k=1: (1 + p) / 11 ms
    assert draft_next_column([[]], [0.11], 1.0, FLAT.t_verify)
    assert not draft_next_column([[]], [0.09], 1.0, FLAT.t_verify)


# --- the proposer -----------------------------------------------------------------------------


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("do_sample", [False, True])
def test_draft_proposer_reports_confidences_and_honours_stop(tiny_factory, do_sample):
    draft = tiny_factory(3)
    calls = []
    proposer = DraftModelProposer(
        RaggedCache(draft, 1), LogitsProcessorList(), do_sample, 0, generator=torch.Generator().manual_seed(0)
    )
    stop = lambda j, conf, growing: calls.append((j, conf, growing)) or j == 3  # noqa: E731
    rows = Rows((PROMPT[0],), (0,), prompt_width=PROMPT.shape[1])
    (proposal,) = proposer.propose(rows, proposer.offer(rows, 5), [5], stop=stop)
    assert proposal.k == 3 and len(proposal.confidences) == 3
    assert [j for j, _, _ in calls] == [1, 2, 3] and calls[-1][1] == [proposal.confidences]
    assert all(growing == [True] for _, _, growing in calls)
    if do_sample:  # q of the sampled token
        picked = proposal.q[0, torch.arange(3), proposal.tokens[0]]
        assert proposal.confidences == pytest.approx(picked.tolist())
    else:  # the draft's top probability, which its greedy token has
        probs = torch.softmax(draft(torch.cat([PROMPT, proposal.tokens], dim=1)).logits[0, -4:-1], dim=-1)
        assert proposal.confidences == pytest.approx(probs.max(dim=-1).values.tolist(), rel=1e-4)
        assert torch.equal(probs.argmax(dim=-1), proposal.tokens[0])


# --- end to end -------------------------------------------------------------------------------

# adaptive without the slowdown bound (tests/test_ledger.py tests it): the stop rule and the calibration are seen
# from a new pair's first steps, whatever the engine's timing
MODES = {
    "adaptive": {"speculation": "adaptive", "max_slowdown": math.inf},
    "pmin": {"speculation": "fixed", "num_speculative_tokens": 8, "draft_p_min": 0.75},
}


def _generate(models, mode: str, drafter: str = "noisy_copy", **kwargs):
    kwargs = {"do_sample": False, "speculation_state": SpeculationState(), **MODES[mode], **kwargs}
    return models["target"].generate(
        PROMPT, assistant_model=models[drafter], speculation_costs=FLAT, return_dict_in_generate=True, **kwargs
    )


@pytest.mark.usefixtures("one_thread", "private_cache")
# fast: adaptive (pmin: test_pmin_extremes runs it); make test runs both
@pytest.mark.parametrize("mode", slow_except(list(MODES), fast={"adaptive"}))
# fast: the perturbed copy (0 < α < 1: stops, acceptances and rejections); the drafts at α ≈ 0 and α = 1 are slow
@pytest.mark.parametrize(
    "drafter",
    [
        pytest.param("other_seed", marks=pytest.mark.slow),
        "noisy_copy",
        pytest.param("same_model", marks=pytest.mark.slow),
    ],
)
def test_confidence_modes_greedy_equal_plain(models, mode, drafter):
    plain = models["target"].generate(PROMPT, max_new_tokens=40, do_sample=False)
    out = _generate(models, mode, drafter, max_new_tokens=40)
    assert torch.equal(out.sequences, plain)
    steps = out.speculation.steps
    assert sum(s.emitted for s in steps) == 39 and all(0 <= s.accepted <= s.k <= 8 for s in steps)


@pytest.mark.usefixtures("one_thread", "private_cache")
# fast: adaptive's goodput stop (pmin's threshold: test_pmin_extremes); make test runs both
@pytest.mark.parametrize("mode", slow_except(list(MODES), fast={"adaptive"}))
def test_the_stop_rule_ends_draft_model_proposals_before_the_cap(models, mode):
    emitted, pairs = 1, []  # (k, the cap k_max = 8 by the budget) per draft-model step
    for step in _generate(models, mode, max_new_tokens=40).speculation.steps:
        if step.drafter == "draft_model":
            pairs.append((step.k, min(8, 40 - emitted - 1)))
        emitted += step.emitted
    assert any(0 < k < cap for k, cap in pairs)
    assert len({k for k, _ in pairs}) > 1


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_pmin_extremes(models):
    never = _generate(models, "pmin", max_new_tokens=20, draft_p_min=0.0, num_speculative_tokens=4)
    emitted = 1
    for step in never.speculation.steps:  # never stops early: k = k, capped by the budget
        assert step.k == min(4, 20 - emitted - 1)
        emitted += step.emitted
    always = _generate(models, "pmin", max_new_tokens=20, draft_p_min=1.0, num_speculative_tokens=4)
    assert max(s.k for s in always.speculation.steps) == 1  # every draft token has q < 1
    with pytest.raises(ValueError, match="draft_p_min"):
        SpeculationConfig("fixed", num_speculative_tokens=4, draft_p_min=1.5)


@pytest.mark.usefixtures("one_thread", "private_cache")
# fast: greedy (sampled confidences: test_draft_proposer_reports_confidences_and_honours_stop[True]); make test: both
@pytest.mark.parametrize("do_sample", slow_except([False, True], fast={False}))
def test_calibration_is_kept_across_requests(models, do_sample):
    """Every drafted token adds one prefix trial to the pair's calibrator; the next request starts from it."""
    made = []
    calibrators = CalibratorMemory(lambda: made.append(ConfidenceCalibrator()) or made[-1])
    state = SpeculationState(calibrators=calibrators)
    torch.manual_seed(0)
    out = _generate(models, "adaptive", max_new_tokens=30, do_sample=do_sample, speculation_state=state)
    (cal,) = made
    drafted = sum(s.k for s in out.speculation.steps if s.drafter == "draft_model")
    assert drafted > 0
    assert sum(cal.trials) == pytest.approx(10 * 2.0 + drafted)
    assert cal.tokens_seen == drafted and cal.token_mean != 0.7
    seeded = cal.token_mean
    _generate(models, "adaptive", max_new_tokens=10, do_sample=do_sample, speculation_state=state)
    assert len(made) == 1 and cal.tokens_seen > drafted and cal.token_mean != seeded
