"""TPOT SLO: controllers skip choices predicted to break it (best effort otherwise); stats report
the share of tokens whose step met it."""

from __future__ import annotations

import math

import pytest
import torch

from hf_adaspec.acceptance import AcceptancePrior
from hf_adaspec.confidence import ConfidenceCalibrator, ConfidenceController
from hf_adaspec.controller import DraftOption, DrafterCosts, GoodputController
from hf_adaspec.costs import CostTable
from hf_adaspec.config import SpeculationConfig
from hf_adaspec.stats import SpeculationStats, StepRecord

FLAT = CostTable(verify_ms=(50.0,) * 9, draft_ms=20.0)  # verification costs 50 ms for 1..9 tokens
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]


def _hybrid(tpot_slo_ms: float | None) -> GoodputController:
    """Draft model (α = 0.9, 20 ms/token, 2 ms per catch-up token) and prompt lookup (α = 0.5, free)."""
    priors = [AcceptancePrior(0.9, 1e9), AcceptancePrior(0.5, 1e9)]  # strong priors: α fixed
    return GoodputController(FLAT, [DrafterCosts(20.0, 2.0), DrafterCosts()], priors, 0.0, tpot_slo_ms)


# Draft model, k=4: E = 4.0951 tokens / 130 ms → 31.5 tokens/s, TPOT 31.75 ms, but 100 catch-up tokens
# (200 ms) over a 64-token horizon bring it to 28.7 tokens/s. Lookup, k=1: 1.5 tokens / 50 ms → 30 tokens/s,
# TPOT 33.3 ms. Draft k=3: TPOT 31.99 ms, k=5: 32.01 ms; plain: TPOT 50 ms.
OPTIONS = [DraftOption(0, 8, catchup_tokens=100), DraftOption(1, 1)]


def test_without_slo_goodput_picks_the_free_lookup():
    decision = _hybrid(None).choose(OPTIONS, horizon=64)
    assert (decision.drafter, decision.k) == (1, 1)


def test_slo_excludes_choices_whose_predicted_tpot_breaks_it():
    decision = _hybrid(32.0).choose(OPTIONS, horizon=64)  # lookup (33.3 ms) and plain (50 ms) excluded
    assert (decision.drafter, decision.k) == (0, 4)
    decision = _hybrid(31.8).choose(OPTIONS, horizon=64)  # only k = 4 meets it
    assert (decision.drafter, decision.k) == (0, 4)


def test_no_option_meets_the_slo_takes_the_lowest_predicted_tpot():
    decision = _hybrid(5.0).choose(OPTIONS, horizon=64)
    assert (decision.drafter, decision.k) == (0, 4)  # 31.75 ms: the fastest per token, though it misses
    decision = _hybrid(5.0).choose([DraftOption(0, 0), DraftOption(1, 0)], horizon=64)
    assert decision.k == 0  # nothing to draft: a plain step, best effort


def test_loose_slo_changes_nothing():
    assert _hybrid(1000.0).choose(OPTIONS, horizon=64) == _hybrid(None).choose(OPTIONS, horizon=64)


def test_confidence_controller_drafts_when_plain_breaks_the_slo():
    # c̄ = 0.12 → P = 0.12: one 1 ms draft token gives TPOT 11/1.12 = 9.82 ms vs plain 10 ms,
    # not enough for the 3% margin, but plain breaks a 9.9 ms SLO
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)

    def controller(slo):
        return ConfidenceController(costs, DrafterCosts(1.0), ConfidenceCalibrator(token_mean=0.12, optimism=0.0), 0.03, slo)

    assert controller(None).choose([DraftOption(0, 4)], horizon=64).k == 0
    assert controller(9.9).choose([DraftOption(0, 4)], horizon=64).k == 4


def _stats(slo: float | None = None) -> SpeculationStats:
    steps = [StepRecord(3, 3, 4, "draft_model", 10.0, 30.0, 0.5, 1.0),  # 10 ms per token
             StepRecord(0, 0, 1, "plain", 0.0, 25.0, 0.5, 1.0)]  # 25 ms per token
    return SpeculationStats(steps=steps, wall_ms=100.0, new_tokens=6, tpot_slo_ms=slo)


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


@pytest.mark.parametrize("value", [0.0, -5.0, float("nan")])
def test_bad_tpot_slo_is_rejected(value):
    with pytest.raises(ValueError, match="tpot_slo_ms"):
        SpeculationConfig(tpot_slo_ms=value)


@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("mode", ["adaptive", "confidence", "fixed"])
def test_generate_with_slo_keeps_greedy_output_and_reports_attainment(models, mode):
    plain = models["target"].generate(PROMPT, max_new_tokens=20, do_sample=False)
    extra = {"num_speculative_tokens": 3} if mode == "fixed" else {}
    out = models["target"].generate(PROMPT, max_new_tokens=20, do_sample=False, speculation=mode,
                                    assistant_model=models["noisy_copy"], tpot_slo_ms=1000.0,
                                    speculation_costs=CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0),
                                    return_dict_in_generate=True, **extra)
    assert torch.equal(out.sequences, plain)
    assert out.speculation.tpot_slo_ms == 1000.0
    assert 0.0 <= out.speculation.slo_attainment() <= 1.0 and "TPOT SLO" in out.speculation.summary()


@pytest.mark.usefixtures("one_thread")
def test_generate_rejects_a_bad_slo(models):
    with pytest.raises(ValueError, match="tpot_slo_ms"):
        models["target"].generate(PROMPT, max_new_tokens=5, speculation="adaptive", tpot_slo_ms=0)
