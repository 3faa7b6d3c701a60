"""TPOT SLO: best_plan skips plans predicted to break it (best effort otherwise), the adaptive
controller passes it on, generate honours it at batch size 1, and stats report the share of tokens
whose step met it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import decide

from hf_adaspec.config import SpeculationConfig
from hf_adaspec.costs.table import CostTable
from hf_adaspec.engine.stats import SpeculationStats, StepRecord
from hf_adaspec.policy.acceptance import ConfidenceAcceptance
from hf_adaspec.policy.confidence import ConfidenceCalibrator
from hf_adaspec.policy.controller import AdaptiveController, StepView
from hf_adaspec.policy.goodput import DrafterPaths, best_plan

FLAT = CostTable(verify_ms=(50.0,) * 9, draft_ms=20.0)  # verification costs 50 ms for 1..9 tokens
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]

# Draft model (α = 0.9, 20 ms/token, 100 catch-up tokens at 2 ms) and prompt lookup (α = 0.5, 1 token, free).
# Draft k=4: E = 4.0951 tokens / 130 ms → 31.5 tokens/s, TPOT 31.75 ms, but the 200 ms catch-up over a
# 64-token horizon brings it to 28.7 tokens/s. Lookup, k=1: 1.5 tokens / 50 ms → 30 tokens/s, TPOT 33.3 ms.
# Draft k=3: TPOT 31.99 ms, k=5: 32.01 ms; plain: TPOT 50 ms.
DRAFTERS = [DrafterPaths((tuple(0.9**j for j in range(1, 9)),), draft_ms=20.0, setup_ms=200.0), DrafterPaths(((0.5,),))]


def _plan(tpot_slo_ms: float | None, drafters=DRAFTERS):
    plan = best_plan(drafters, FLAT.t_verify, horizon=64, tpot_slo_ms=tpot_slo_ms)
    return plan.drafters[0], plan.k


def test_without_slo_goodput_picks_the_free_lookup():
    assert _plan(None) == (1, 1)


def test_slo_excludes_plans_whose_predicted_tpot_breaks_it():
    assert _plan(32.0) == (0, 4)  # lookup (33.3 ms) and plain (50 ms) excluded
    assert _plan(31.8) == (0, 4)  # only k = 4 meets it


def test_no_plan_meets_the_slo_takes_the_lowest_predicted_tpot():
    assert _plan(5.0) == (0, 4)  # 31.75 ms: the fastest per token, though it misses
    nothing = [DrafterPaths(((),), draft_ms=20.0), DrafterPaths(((),))]
    assert _plan(5.0, nothing)[1] == 0  # nothing to draft: a plain step, best effort


def test_loose_slo_changes_nothing():
    assert best_plan(DRAFTERS, FLAT.t_verify, 64, tpot_slo_ms=1000.0) == best_plan(DRAFTERS, FLAT.t_verify, 64)


def test_slo_overrides_the_margin_when_plain_breaks_it():
    # P_1 = 0.12: one 1 ms draft token gives TPOT 11/1.12 = 9.82 ms vs plain 10 ms, not enough for the
    # 3% margin, but plain breaks a 9.9 ms SLO
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
    drafters = [DrafterPaths(((0.12,),), draft_ms=1.0)]
    assert best_plan(drafters, costs.t_verify, min_gain=0.03).k == 0
    assert best_plan(drafters, costs.t_verify, min_gain=0.03, tpot_slo_ms=9.9).k == 1


def test_adaptive_controller_drafts_when_plain_breaks_the_slo():
    # c̄ = 0.12 → P = 0.12 (identity calibration): as above, with the controller's own 3% margin
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)

    def ks(slo):
        model = ConfidenceAcceptance(1, ConfidenceCalibrator(token_mean=0.12, optimism=0.0))
        return decide(
            AdaptiveController(lambda b: costs, [model], [True], tpot_slo_ms=slo), StepView(((4,),), (0,), horizon=64)
        ).ks

    assert ks(None) == (0,)
    assert ks(9.9) == (4,)  # the stop rule ends the draft


def _stats(slo: float | None = None) -> SpeculationStats:
    steps = [
        StepRecord(3, 3, 4, "draft_model", 10.0, 30.0, 0.5, 1.0),  # 10 ms per token
        StepRecord(0, 0, 1, "plain", 0.0, 25.0, 0.5, 1.0, step=1),
    ]  # 25 ms per token
    return SpeculationStats(steps=steps, wall_ms=100.0, row_tokens=(6,), finish_ms=(100.0,), tpot_slo_ms=slo)


def test_slo_attainment_counts_tokens_of_steps_within_the_slo():
    assert _stats().slo_attainment(20.0) == pytest.approx(0.8)
    assert _stats().slo_attainment(25.0) == 1.0
    assert _stats().slo_attainment(5.0) == 0.0
    assert math.isnan(SpeculationStats().slo_attainment(20.0))


def test_stats_report_attainment_when_an_slo_was_set():
    stats = _stats(20.0)
    assert stats.slo_attainment() == pytest.approx(0.8)
    assert "TPOT SLO 20 ms met by 80% of tokens" in stats.summary()
    assert stats.to_dict()["slo_attainment"] == pytest.approx(0.8)
    assert "SLO" not in _stats().summary() and _stats().to_dict()["slo_attainment"] is None
    with pytest.raises(ValueError, match="tpot_slo_ms"):
        _stats().slo_attainment()
    assert stats.row(0).slo_attainment() == pytest.approx(0.8)  # a row's view keeps the SLO


@pytest.mark.parametrize("value", [0.0, -5.0, float("nan")])
def test_bad_tpot_slo_is_rejected(value):
    with pytest.raises(ValueError, match="tpot_slo_ms"):
        SpeculationConfig(tpot_slo_ms=value)


@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize(  # the fast suite keeps adaptive with and without a draft model; make test runs fixed too
    "mode, drafter",
    [("adaptive", "noisy_copy"), ("adaptive", None), pytest.param("fixed", "noisy_copy", marks=pytest.mark.slow)],
)
def test_generate_with_slo_keeps_greedy_output_and_reports_attainment(models, mode, drafter):
    plain = models["target"].generate(PROMPT, max_new_tokens=20, do_sample=False)
    extra = {"num_speculative_tokens": 3} if mode == "fixed" else {}
    out = models["target"].generate(
        PROMPT,
        max_new_tokens=20,
        do_sample=False,
        speculation=mode,
        assistant_model=models.get(drafter),
        tpot_slo_ms=1000.0,
        speculation_costs=CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0),
        return_dict_in_generate=True,
        **extra,
    )
    assert torch.equal(out.sequences, plain)
    assert out.speculation.tpot_slo_ms == 1000.0
    assert 0.0 <= out.speculation.slo_attainment() <= 1.0 and "TPOT SLO" in out.speculation.summary()


@pytest.mark.usefixtures("one_thread")
def test_generate_rejects_a_bad_slo(models):
    with pytest.raises(ValueError, match="tpot_slo_ms"):
        models["target"].generate(PROMPT, max_new_tokens=5, speculation="adaptive", tpot_slo_ms=0)


@pytest.mark.usefixtures("one_thread")
def test_generate_rejects_an_slo_for_a_batch(models):
    with pytest.raises(ValueError, match="tpot_slo_ms supports batch size 1"):
        models["target"].generate(PROMPT.repeat(2, 1), max_new_tokens=5, speculation="adaptive", tpot_slo_ms=50.0)
