"""Resting: after plain decisions in a row the controller skips deciding for 1, 2, 4, … steps, up to the
steps over which a decision costs at most its share; a rested step is a plain step the drafters neither offer
for nor learn from, and the tokens are the same as when every step is decided."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import PlainController
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

from hf_adaspec import SpeculationConfig, SpeculationState
from hf_adaspec.backend.ragged import RaggedCache
from hf_adaspec.costs.table import CostTable
from hf_adaspec.engine.loop import speculative_decode
from hf_adaspec.engine.run import build_run
from hf_adaspec.engine.settings import DecodeSettings, RunParts
from hf_adaspec.policy.rest import RestSchedule, rest_steps
from hf_adaspec.proposers import PromptLookupProposer

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]


@pytest.mark.parametrize(
    "decision_ms, step_ms, share, most, expected",
    [
        (0.5, 5.0, 0.01, 16, 9),  # ⌈0.5 / 0.05⌉ − 1: the decision's 0.5 ms over 10 steps of 5 ms is 1%
        (0.51, 5.0, 0.01, 16, 10),
        (0.5, 5.0, 0.01, 4, 4),  # capped
        (0.2, 80.0, 0.01, 16, 0),  # a decision far below 1% of a step: decide every step
        (0.0, 5.0, 0.01, 16, 0),
        (0.5, math.nan, 0.01, 16, 0),
        (math.nan, 5.0, 0.01, 16, 0),
        (0.5, 0.0, 0.01, 16, 0),
    ],
)
def test_rest_steps_keep_the_decisions_within_their_share(decision_ms, step_ms, share, most, expected):
    assert rest_steps(decision_ms, step_ms, share, most) == expected


@pytest.mark.parametrize("kwargs", [{"share": 0.0}, {"share": 1.5}, {"most": -1}, {"after": 0}, {"window": 0}])
def test_a_rest_schedule_refuses_bad_settings(kwargs):
    with pytest.raises(ValueError, match="share|most|after"):
        RestSchedule(**kwargs)


def _rests_after(schedule: RestSchedule) -> int:
    n = 0
    while schedule.rests():
        n += 1
    return n


def test_rests_back_off_exponentially_up_to_the_budget_and_a_speculative_decision_ends_them():
    schedule = RestSchedule(share=0.01, after=2, most=16, window=3)
    schedule.decided(True, 0.5, 5.0)  # one plain decision: no rest yet
    assert _rests_after(schedule) == 0
    rests = []
    for _ in range(6):  # the 2nd … 7th plain decisions in a row
        schedule.decided(True, 0.5, 5.0)
        rests.append(_rests_after(schedule))
    assert rests == [1, 2, 4, 8, 9, 9]  # 2^(r − 2), then the budget ⌈0.5 / 0.05⌉ − 1
    schedule.decided(False, 0.5, 5.0)  # a speculative step ends the run
    schedule.decided(True, 0.5, 5.0)
    assert _rests_after(schedule) == 0


def test_no_rest_before_most_of_the_window_is_measured():
    schedule, rests = RestSchedule(window=9), []
    for ms in (5.0, 0.5, 0.5, 0.5, 0.5, 0.5):  # a cold first decision, then warm ones
        schedule.decided(True, ms, 5.0)
        rests.append(_rests_after(schedule))
    assert rests == [0, 0, 0, 0, 8, 9]  # from the 5th of 9 on: min(2^(r − 2), 9)


def test_no_rest_without_a_measured_decision_or_a_cost_model():
    unmeasured, uncosted = RestSchedule(), RestSchedule()
    for _ in range(5):
        unmeasured.decided(True, math.nan, 5.0)
        uncosted.decided(True, 0.5, math.nan)
    assert _rests_after(unmeasured) == 0 and _rests_after(uncosted) == 0


class _CountingOffers(PromptLookupProposer):
    offered = 0

    def offer(self, rows, k_max):
        self.offered += 1
        return super().offer(rows, k_max)


@pytest.mark.parametrize("decision_ms", [None, 2.5])
def test_a_rested_step_has_no_offer_and_no_observation(models, one_thread, decision_ms):
    lookup, controller = _CountingOffers(), PlainController(rest_on=lambda n: n % 2 == 0)
    settings = DecodeSettings(
        LogitsProcessorList(),
        StoppingCriteriaList([MaxLengthCriteria(24 + 11)]),
        24 + 11,
        False,
        decision_ms=decision_ms,
    )
    result = speculative_decode(
        RunParts(RaggedCache(models["target"], 1), (lookup,), controller, settings, 8), PROMPT, torch.ones_like(PROMPT)
    )
    assert [r.decided for r in result.stats.steps] == [True, False] * 5  # 10 steps after the prefill's token
    assert lookup.offered == 5 and len(controller.outcomes) == 5
    assert all(o.hindsight[0] for o in controller.outcomes)  # decided steps still score the offer
    times = [o.decision_ms for o in controller.outcomes]
    assert times == [2.5] * 5 if decision_ms is not None else all(0.0 < t < 10_000.0 for t in times)


def _adaptive(models, decision_ms: float) -> tuple[torch.Tensor, list[bool]]:
    settings = DecodeSettings(
        LogitsProcessorList(),
        StoppingCriteriaList([MaxLengthCriteria(24 + 48)]),
        24 + 48,
        False,
        decision_ms=decision_ms,
    )

    class Caches:
        def target(self, batch, layers=()):
            return RaggedCache(models["target"], batch)

    costs = CostTable(verify_ms=(10.0,) + (30.0,) * 8, draft_ms=0.0)  # speculation pays only on long matches
    run = build_run(
        SpeculationConfig(),
        SpeculationState(),
        PROMPT,
        torch.ones_like(PROMPT),
        None,
        Caches(),
        lambda b: costs,
        settings,
    )
    result = speculative_decode(run.parts, PROMPT, torch.ones_like(PROMPT))
    return result.sequences, [r.decided for r in result.stats.steps]


def test_an_adaptive_run_rests_only_where_deciding_costs_and_emits_the_same_tokens(models, one_thread):
    resting, rested = _adaptive(models, decision_ms=1.0)  # 10% of a 10 ms step: rests up to 16 steps
    deciding, decided = _adaptive(models, decision_ms=0.0)
    assert not all(rested) and all(decided)
    assert torch.equal(resting, deciding)  # fp32: a rested step is the plain step a decision would make
