"""Learned state: where prompt lookup's and the draft's acceptance start, what carries to the next request,
and that it is kept per ``SpeculationState`` (the model's own, or one given per call)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import decide

import hf_adaspec
from hf_adaspec import CostTable, SpeculationConfig, SpeculationState
from hf_adaspec.engine.owner import ModelState
from hf_adaspec.policy.confidence import CalibratorMemory, ConfidenceCalibrator
from hf_adaspec.policy.controller import StepView
from hf_adaspec.policy.match import LOOKUP_START_ALPHA, MatchMemory
from hf_adaspec.policy.modes import DRAFT_MODEL, MODES, PROMPT_LOOKUP, Learned, PolicyInputs

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]


def _adaptive(matches: MatchMemory, costs: CostTable):
    drafters = ((DRAFT_MODEL, "d"), (PROMPT_LOOKUP, "l"))
    inputs = PolicyInputs(
        SpeculationConfig("adaptive", max_slowdown=math.inf),
        lambda b: costs,
        1,
        drafters,
        Learned(CalibratorMemory(), matches),
    )
    return MODES["adaptive"].controller(inputs)


def test_adaptive_mode_starts_lookup_at_its_own_rate_and_the_draft_model_optimistically():
    cheap_draft = CostTable(verify_ms=(10.0,) * 9, draft_ms=0.5)
    decision = decide(_adaptive(MatchMemory(), cheap_draft), StepView(((8,), (0,)), (0, 0), 64, ((0,), (0,))))
    assert decision.drafters == (0,) and decision.ks == (8,) and decision.alphas[0] > 0.6
    dear_draft = CostTable(verify_ms=(10.0,) * 9, draft_ms=50.0)
    matches = MatchMemory()
    decision = decide(_adaptive(matches, dear_draft), StepView(((8,), (8,)), (0, 0), 64, ((0,), (3,))))
    assert decision.drafters == (1,) and decision.alphas == (pytest.approx(LOOKUP_START_ALPHA),)
    for _ in range(20):  # lookup's hindsight at match length 3 replaces its start rate, also in a new request
        matches.table_for("l").observe(3, 4, 4)
    decision = decide(_adaptive(matches, dear_draft), StepView(((8,), (8,)), (0, 0), 64, ((0,), (3,))))
    assert decision.alphas[0] > 0.9


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_a_given_speculation_state_learns_instead_of_the_models_own(tiny_factory):
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(0)
    costs = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
    made = []  # the calibrators the given state creates
    own = ModelState(target)
    given = SpeculationState(calibrators=CalibratorMemory(lambda: made.append(ConfidenceCalibrator()) or made[-1]))

    def run(**kwargs):
        return hf_adaspec.api.generate._speculative_entry(
            target.generate.__wrapped__,
            own,
            speculation="adaptive",
            inputs=PROMPT,
            assistant_model=draft,
            speculation_costs=costs,
            max_new_tokens=12,
            do_sample=False,
            return_dict_in_generate=True,
            max_slowdown=math.inf,
            **kwargs,
        )  # the draft drafts (and learns) from the first step

    run()
    (mine,) = own.learned.calibrators._calibrators.values()
    seen = mine.tokens_seen
    assert seen > 0  # the draft's calibration learned in the model's own state
    out = run(speculation_state=given)
    assert mine.tokens_seen == seen  # and the given state learned instead
    drafted = sum(s.k for s in out.speculation.steps if s.drafter == "draft_model")
    assert drafted > 0 and len(made) == 1 and made[0].tokens_seen == drafted  # the calibration learned there


def test_a_speculation_state_without_speculation_names_the_fix(models):
    with pytest.raises(ValueError, match="speculation="):
        models["target"].generate(PROMPT, max_new_tokens=2, speculation_state=SpeculationState())
