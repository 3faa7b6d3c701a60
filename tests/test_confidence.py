"""Confidence-prior drafting (AdaSpec): PAV, calibration, prefix goodput math, the stopping rule,
p_min, and speculation="confidence" / "pmin" end to end on tiny random Llamas."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers import LogitsProcessorList

from hf_adaspec.acceptance import AcceptanceMemory
from hf_adaspec.confidence import (
    CalibratorMemory,
    ConfidenceCalibrator,
    ConfidenceController,
    PMinController,
    expected_tokens_prefix,
    isotonic,
    pmin_stop,
    prefix_confidences,
    prefix_goodput,
    prefix_tpot_ms,
    should_draft_next,
)
from hf_adaspec.controller import DraftOption, DrafterCosts
from hf_adaspec.costs import CostTable
from hf_adaspec.goodput import expected_tokens
from hf_adaspec.integration import SpeculationState, _speculative_entry
from hf_adaspec.proposers import DraftModelProposer

FLAT = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # verification costs 10 ms for 1..9 tokens
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]


# --- pure functions ---------------------------------------------------------------------------

@pytest.mark.parametrize("values, weights, expected", [
    ([1, 2, 3], [1, 1, 1], (1, 2, 3)),
    ([3, 1], [1, 1], (2, 2)),
    ([1, 3, 2, 4], [1, 1, 1, 1], (1, 2.5, 2.5, 4)),
    ([4, 3, 2, 1], [1, 1, 1, 1], (2.5, 2.5, 2.5, 2.5)),
    ([0.9, 0.1], [3, 1], (0.7, 0.7)),
    ([0.0, 1.0, 0.0, 1.0], [1, 1, 2, 1], (0.0, 1 / 3, 1 / 3, 1.0)),
    ([], [], ()),
])
def test_isotonic_pool_adjacent_violators(values, weights, expected):
    assert isotonic(values, weights) == pytest.approx(expected)


@pytest.mark.parametrize("values, weights", [([1, 2], [1]), ([1, 2], [1, 0]), ([1], [float("nan")])])
def test_isotonic_rejects_bad_weights(values, weights):
    with pytest.raises(ValueError):
        isotonic(values, weights)


def test_prefix_confidences_are_running_products():
    assert prefix_confidences((1.0, 0.8, 0.5)) == pytest.approx((1.0, 0.8, 0.4))
    assert prefix_confidences(()) == ()


def test_expected_tokens_prefix_generalises_leviathan_eq1():
    assert expected_tokens_prefix([]) == 1.0
    assert expected_tokens_prefix([0.8, 0.5, 0.2]) == pytest.approx(2.5)
    alpha = 0.7  # i.i.d. acceptance: P(prefix j) = α^j gives Eq. 1's closed form
    assert expected_tokens_prefix([alpha ** j for j in (1, 2, 3)]) == pytest.approx(expected_tokens(alpha, 3))
    with pytest.raises(ValueError):
        expected_tokens_prefix([1.5])


def test_prefix_goodput_and_tpot():
    costs = CostTable(verify_ms=(10.0, 12.0, 14.0), draft_ms=2.0)
    # k=2: E = 1 + .8 + .5 = 2.3 tokens over 2·2 + t_verify(3)=14 → 18 ms
    assert prefix_goodput([0.8, 0.5], 2.0, costs.t_verify) == pytest.approx(1000 * 2.3 / 18)
    assert prefix_tpot_ms([0.8, 0.5], 2.0, costs.t_verify) == pytest.approx(18 / 2.3)
    assert prefix_goodput([], 2.0, costs.t_verify) == pytest.approx(100.0)  # a plain 10 ms step


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


def test_calibrator_learns_a_known_mapping_and_stays_monotone():
    truth = lambda c: c ** 2  # noqa: E731 — the draft is over-confident
    rng, cal = random.Random(0), ConfidenceCalibrator(n_bins=10, optimism=0.0)
    for _ in range(20000):
        c = rng.random()
        cal.update((c,), accepted=int(rng.random() < truth(c)))
    for c in (0.15, 0.35, 0.55, 0.75, 0.95):
        assert cal.predict(c) == pytest.approx(truth(c), abs=0.03)
    grid = [cal.predict(i / 100) for i in range(101)]
    assert all(a <= b for a, b in zip(grid, grid[1:]))


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


def test_cold_start_drafts_to_learn_then_stops_when_drafts_fail():
    # verify 10 ms/step, draft 3 ms/token: at P = c̄ = 0.15, k=1 predicts 1.15/13 < 1/10, so the mean
    # calibration never drafts and, observing nothing, never learns; the optimistic one tries
    pessimist = ConfidenceController(FLAT, DrafterCosts(3.0), ConfidenceCalibrator(token_mean=0.15, optimism=0.0))
    assert pessimist.choose([DraftOption(0, 4)], horizon=64).k == 0
    ctl = ConfidenceController(FLAT, DrafterCosts(3.0), ConfidenceCalibrator(token_mean=0.15, optimism=2.0))
    assert ctl.choose([DraftOption(0, 4)], horizon=64).k == 4
    for _ in range(200):  # every draft at this confidence is rejected
        ctl.observe(0, drafted=1, accepted=0, confidences=(0.15,))
    assert ctl.choose([DraftOption(0, 4)], horizon=64).k == 0


# --- stopping rule ----------------------------------------------------------------------------

def test_should_draft_next_stops_exactly_when_goodput_would_fall():
    # j=1 with P_1 = 0.9: goodput(1) = 1.9 / 11 ms; goodput(2) = (1.9 + p) / 12 ms rises iff p > 1.9/11
    threshold = 1.9 / 11
    assert should_draft_next([0.9], threshold + 1e-6, 1.0, FLAT.t_verify)
    assert not should_draft_next([0.9], threshold - 1e-6, 1.0, FLAT.t_verify)
    assert not should_draft_next([0.5], 0.0, 0.0, FLAT.t_verify)  # free drafts, flat verify: a tie stops
    assert should_draft_next([0.5], 0.01, 0.0, FLAT.t_verify)


def test_first_token_must_beat_a_plain_step_by_min_gain():
    # plain: 1 token / 10 ms; k=1: (1 + p) / 11 ms
    assert should_draft_next([], 0.11, 1.0, FLAT.t_verify)
    assert not should_draft_next([], 0.09, 1.0, FLAT.t_verify)
    assert not should_draft_next([], 0.2, 1.0, FLAT.t_verify, min_gain=0.1)  # needs p > 0.21
    assert should_draft_next([], 0.22, 1.0, FLAT.t_verify, min_gain=0.1)


def test_catchup_amortised_over_the_horizon():
    # k=1 at p=0.5: 136 tokens/s steady state, but a 100 ms catch-up over 10 tokens drops it below plain
    assert not should_draft_next([], 0.5, 1.0, FLAT.t_verify, setup_ms=100.0, horizon=10)
    assert should_draft_next([], 0.5, 1.0, FLAT.t_verify, setup_ms=100.0, horizon=1000)


def test_slo_overrides_the_margin_when_plain_breaks_it():
    # k=1 at p=0.12: TPOT 11/1.12 = 9.82 ms < plain's 10 ms, but the 3% margin keeps plain
    assert not should_draft_next([], 0.12, 1.0, FLAT.t_verify, min_gain=0.03)
    assert should_draft_next([], 0.12, 1.0, FLAT.t_verify, min_gain=0.03, tpot_slo_ms=9.9)


def test_pmin_stop_rule():
    stop = pmin_stop(0.75)
    assert not stop(1, (0.8,))
    assert stop(2, (0.8, 0.7))
    assert not stop(2, (0.8, 0.75))  # strictly below p_min stops
    with pytest.raises(ValueError):
        PMinController(1.5)


def _controller(token_mean: float, min_gain: float = 0.0) -> ConfidenceController:
    """Identity calibration (P = c on [0.05, 0.95]), c̄ = token_mean, 1 ms drafts, 10 ms verification."""
    return ConfidenceController(FLAT, DrafterCosts(draft_ms=1.0), ConfidenceCalibrator(token_mean=token_mean, optimism=0.0),
                                min_gain)


def test_confidence_controller_stop_rule_predicts_then_corrects():
    stop = _controller(token_mean=0.9).stop_rule(0)
    assert not stop(1, (0.9,))  # ĉ_2 = 0.81 ≫ 1.9/11: keep drafting
    assert stop(1, (0.1,))  # P_1 = 0.1, ĉ_2 = 0.09 < 1.1/11 = 0.1: stop
    assert not stop(1, (0.2,))  # P_1 = 0.2, ĉ_2 = 0.18 > 1.2/11: keep drafting
    assert stop(3, (0.9, 0.3, 0.3))  # real c_3 = 0.081 (not c̄^3 = 0.73): ĉ_4 = 0.073 does not pay


def test_confidence_controller_choose_plain_or_cap():
    assert _controller(token_mean=0.9).choose([DraftOption(0, 6)], horizon=64).k == 6
    assert _controller(token_mean=0.06).choose([DraftOption(0, 6)], horizon=64).k == 0  # P(ĉ_1) ≈ 0.06 < 0.1
    far_behind = DraftOption(0, 6, catchup_tokens=2000)
    ctl = ConfidenceController(FLAT, DrafterCosts(1.0, catchup_ms=1.0), ConfidenceCalibrator(token_mean=0.9, optimism=0.0))
    assert ctl.choose([far_behind], horizon=8).k == 0  # a 2 s catch-up for 8 tokens


def test_confidence_controller_observe_corrects_calibration_and_mean():
    ctl = _controller(token_mean=0.5)
    ctl.observe(0, drafted=2, accepted=2, confidences=(0.9, 0.9))
    assert sum(ctl.calibrator.trials) == pytest.approx(10 * 2.0 + 2)
    assert ctl.c_bar.value == pytest.approx((4 * 0.5 + 0.9 + 0.9) / 6)
    ctl.observe(0, drafted=0, accepted=0)  # a plain step leaves the calibration alone
    assert sum(ctl.calibrator.trials) == pytest.approx(22.0)


def test_request_seed_is_an_upper_quantile_of_past_request_means():
    cal = ConfidenceCalibrator(token_mean=0.6, seed_quantile=0.75)
    for mean in (0.5, 0.95):
        cal.note_request(None, mean)
    assert cal.request_seed() == 0.6  # fewer than 3 requests: the pair's token mean
    slot = cal.note_request(None, 0.7)
    cal.note_request(None, 0.9)
    assert cal.request_seed() == 0.9  # nearest rank: ceil(0.75 · 4) = 3rd of 0.5, 0.7, 0.9, 0.95
    cal.note_request(slot, 0.99)  # a request's mean is updated in place, not appended
    assert cal.request_means == [0.5, 0.95, 0.99, 0.9] and cal.request_seed() == 0.95
    with pytest.raises(ValueError, match="seed_quantile"):
        ConfidenceCalibrator(seed_quantile=1.5)


def test_each_request_records_its_mean_and_seeds_the_next_one():
    cal = ConfidenceCalibrator(token_mean=0.5, seed_quantile=0.75)
    for qs in ((0.2, 0.4), (0.9,), (0.8, 1.0)):  # three requests, one controller each
        ctl = ConfidenceController(FLAT, DrafterCosts(3.0), cal)
        ctl.observe(0, drafted=len(qs), accepted=0, confidences=qs)
        ctl.observe(0, drafted=0, accepted=0)  # plain steps add nothing
    assert cal.request_means == pytest.approx([0.3, 0.9, 0.9])
    assert ConfidenceController(FLAT, DrafterCosts(3.0), cal).c_bar.value == pytest.approx(0.9)


def test_an_optimistic_seed_drafts_where_the_pair_mean_would_not():
    # verify 10 ms, draft 3 ms: P = c̄ (no optimism); c̄ 0.15 never drafts, a request seeded at 0.9 does
    cal = ConfidenceCalibrator(token_mean=0.15, optimism=0.0, seed_quantile=0.75)
    assert ConfidenceController(FLAT, DrafterCosts(3.0), cal).choose([DraftOption(0, 4)], horizon=64).k == 0
    cal.request_means.extend([0.9, 0.9, 0.9])
    assert ConfidenceCalibrator(token_mean=0.15, seed_quantile=None).request_seed() == 0.15
    assert ConfidenceController(FLAT, DrafterCosts(3.0), cal).choose([DraftOption(0, 4)], horizon=64).k == 4


# --- the proposer -----------------------------------------------------------------------------

@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("do_sample", [False, True])
def test_draft_proposer_reports_confidences_and_honours_stop(tiny_factory, do_sample):
    draft = tiny_factory(3)
    calls = []
    proposer = DraftModelProposer(draft, LogitsProcessorList(), do_sample, generator=torch.Generator().manual_seed(0))
    proposal = proposer.propose(PROMPT, 5, stop=lambda j, conf: calls.append((j, conf)) or j == 3)
    assert proposal.k == 3 and len(proposal.confidences) == 3
    assert [j for j, _ in calls] == [1, 2, 3] and calls[-1][1] == proposal.confidences
    if do_sample:  # q of the sampled token
        picked = proposal.q[0, torch.arange(3), proposal.tokens[0]]
        assert proposal.confidences == pytest.approx(picked.tolist())
    else:  # the draft's top probability, which its greedy token has
        probs = torch.softmax(draft(torch.cat([PROMPT, proposal.tokens], dim=1)).logits[0, -4:-1], dim=-1)
        assert proposal.confidences == pytest.approx(probs.max(dim=-1).values.tolist(), rel=1e-4)
        assert torch.equal(probs.argmax(dim=-1), proposal.tokens[0])


# --- end to end -------------------------------------------------------------------------------

def _generate(models, mode: str, drafter: str = "noisy_copy", **kwargs):
    kwargs.setdefault("do_sample", False)
    return models["target"].generate(PROMPT, speculation=mode, assistant_model=models[drafter],
                                     speculation_costs=FLAT, return_dict_in_generate=True, **kwargs)


@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("mode", ["confidence", "pmin"])
@pytest.mark.parametrize("drafter", ["other_seed", "noisy_copy", "same_model"])
def test_confidence_modes_greedy_equal_plain(models, mode, drafter):
    plain = models["target"].generate(PROMPT, max_new_tokens=40, do_sample=False)
    out = _generate(models, mode, drafter, max_new_tokens=40)
    assert torch.equal(out.sequences, plain)
    steps = out.speculation.steps
    assert sum(s.emitted for s in steps) == 39 and all(0 <= s.accepted <= s.k <= 8 for s in steps)


@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("mode", ["confidence", "pmin"])
def test_proposal_length_varies_per_step(models, mode):
    emitted, pairs = 1, []  # (k, the cap k_max = 8 by the budget) per step
    for step in _generate(models, mode, max_new_tokens=40).speculation.steps:
        pairs.append((step.k, min(8, 40 - emitted - 1)))
        emitted += step.emitted
    assert any(0 < k < cap for k, cap in pairs)  # the stop rule ended a proposal before the cap
    assert len({k for k, _ in pairs}) > 1


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_pmin_extremes(models):
    never = _generate(models, "pmin", max_new_tokens=20, draft_p_min=0.0, max_speculative_tokens=4)
    emitted = 1
    for step in never.speculation.steps:  # never stops early: k = k_max, capped by the budget
        assert step.k == min(4, 20 - emitted - 1)
        emitted += step.emitted
    always = _generate(models, "pmin", max_new_tokens=20, draft_p_min=1.0, max_speculative_tokens=4)
    assert max(s.k for s in always.speculation.steps) == 1  # every draft token has q < 1


@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("do_sample", [False, True])
def test_calibration_is_kept_across_requests(models, do_sample):
    """Every drafted token adds one prefix trial to the pair's calibrator; the next request starts from it."""
    memory, calibrators = AcceptanceMemory(), CalibratorMemory()
    original = models["target"].generate.__wrapped__  # transformers' own generate, as enable() wrapped it
    torch.manual_seed(0)
    out = _speculative_entry(original, SpeculationState(memory, calibrators), speculation="confidence", inputs=PROMPT,
                             assistant_model=models["noisy_copy"], speculation_costs=FLAT, max_new_tokens=30,
                             do_sample=do_sample, return_dict_in_generate=True)
    (cal,) = calibrators._calibrators.values()
    drafted = sum(s.k for s in out.speculation.steps)
    assert drafted > 0
    assert sum(cal.trials) == pytest.approx(10 * 2.0 + drafted)
    assert cal.tokens_seen == drafted and cal.token_mean != 0.7
    seeded = cal.token_mean
    _speculative_entry(original, SpeculationState(memory, calibrators), speculation="confidence", inputs=PROMPT,
                       assistant_model=models["noisy_copy"], speculation_costs=FLAT, max_new_tokens=10,
                       do_sample=do_sample)
    assert len(calibrators._calibrators) == 1 and cal.tokens_seen > drafted and cal.token_mean != seeded


def test_confidence_controller_amortises_catchup_over_the_whole_predicted_run():
    """A 60 ms catch-up over a 12-token horizon: one draft token does not pay it, six do."""
    from hf_adaspec.confidence import prefix_candidate

    ctl = ConfidenceController(FLAT, DrafterCosts(1.0, catchup_ms=1.0), ConfidenceCalibrator(token_mean=0.9, optimism=0.0))
    one = prefix_candidate([ctl.calibrator.predict(0.9)], 1.0, FLAT.t_verify, setup_ms=60.0, horizon=12)
    assert one.rate < 100.0  # plain: 1 token per 10 ms
    assert ctl.choose([DraftOption(0, 6, catchup_tokens=60)], horizon=12).k == 6
