"""The horizon (tokens still to come) over which a draft's catch-up is amortised, learned per model."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

import hf_adaspec
from hf_adaspec import CostTable
from hf_adaspec.engine.loop import DecodeSettings, speculative_decode
from hf_adaspec.policy.controller import FixedController, StepView
from hf_adaspec.policy.horizon import LengthMemory, expected_remaining, lindy_horizon
from hf_adaspec.proposers import PromptLookupProposer

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]
# α = 1 draft at 1 ms/token, 10 ms/verify, 1 ms per token of catch-up: ingesting the 24-token prompt
# pays over a horizon of tens of tokens, not over 1 or 2 (horizon_goodput against a 100 tokens/s plain step).
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0, draft_catchup_ms=1.0)


def test_lindy_horizon_by_hand():
    assert lindy_horizon(0, 5) == 1
    assert lindy_horizon(3, 10) == 3
    assert lindy_horizon(20, 10) == 10


def test_expected_remaining_by_hand():
    lengths = [3, 10, 64, 64]
    assert expected_remaining(5, 59, lengths) == pytest.approx((5 + 59 + 59) / 3)  # 3 ended before 5: not like us
    assert expected_remaining(10, 54, lengths) == pytest.approx(54.0)
    assert expected_remaining(5, 20, lengths) == pytest.approx((5 + 20 + 20) / 3)  # capped by tokens left
    assert expected_remaining(64, 100, lengths) is None
    assert expected_remaining(0, 10, []) is None
    with pytest.raises(ValueError, match=">= 0"):
        expected_remaining(-1, 10, lengths)


def test_length_memory_falls_back_to_lindy_and_keeps_the_last_requests():
    memory = LengthMemory(size=2)
    assert memory.horizon(3, 50) == 3  # no history: as many as so far
    memory.record(40)
    assert memory.horizon(3, 50) == 37
    assert memory.horizon(3, 10) == 10  # never past the tokens left
    assert memory.horizon(39, 50) == 1
    assert memory.horizon(45, 50) == 45  # nothing ran this long: lindy again
    memory.record(4)
    memory.record(5)
    assert list(memory.lengths) == [4, 5]
    assert memory.horizon(1, 50) == 4  # the 40-token request fell out: mean of 3 and 4, rounded
    with pytest.raises(ValueError, match=">= 0"):
        memory.record(-1)
    with pytest.raises(ValueError, match="size"):
        LengthMemory(size=0)


class _Spy(FixedController):
    """A fixed-k controller that keeps every StepView it is shown."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.views: list[StepView] = []

    def decide(self, view: StepView):
        self.views.append(view)
        return super().decide(view)


def test_engine_asks_the_settings_horizon_with_generated_and_tokens_left(models):
    calls = []

    def horizon(generated, tokens_left):
        calls.append((generated, tokens_left))
        return 1000 + generated

    stop = StoppingCriteriaList([MaxLengthCriteria(24 + 12)])
    settings = DecodeSettings(LogitsProcessorList(), stop, 24 + 12, False, 8, horizon=horizon)
    controller = _Spy(2)
    speculative_decode(models["target"], PROMPT, torch.ones_like(PROMPT), [PromptLookupProposer()], controller,
                       settings)
    assert calls[0] == (1, 11)  # after the prefill's token: 1 generated, 11 of 12 left
    assert all(g + left == 12 for g, left in calls) and len(calls) == len(controller.views)
    assert [v.horizon for v in controller.views] == [1000 + g for g, _ in calls]  # what the controller sees


def _first_k(target, draft, state: hf_adaspec.SpeculationState) -> int:
    """k of the first step with a fresh draft cache (a fresh state: no prompt prefix to reuse)."""
    out = target.generate(PROMPT, assistant_model=draft, speculation="adaptive", speculation_costs=COSTS,
                          max_new_tokens=40, do_sample=False, return_dict_in_generate=True, speculation_state=state)
    return out.speculation.steps[0].k


def test_a_model_that_ran_long_requests_drafts_from_the_first_step(tiny_factory):
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(0)
    assert _first_k(target, draft, hf_adaspec.SpeculationState()) == 0  # no history: 1 token cannot pay the prompt
    state = hf_adaspec.SpeculationState()
    target.generate(PROMPT, speculation="adaptive", max_new_tokens=40, do_sample=False,
                    speculation_costs=COSTS, speculation_state=state)  # 40 tokens by prompt lookup, recorded
    assert _first_k(target, draft, state) > 0  # this one is expected to run as long


def test_the_mean_remaining_length_decides_the_first_step(tiny_factory):
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(0)

    def first_k(lengths):
        state = hf_adaspec.SpeculationState()
        for length in lengths:
            state.lengths.record(length)
        return _first_k(target, draft, state)

    assert first_k((3, 40, 40, 40)) > 0  # one short answer among long ones: about 30 tokens to come
    assert first_k((3, 3, 3, 3)) == 0  # only short answers: 2 tokens to come do not pay the catch-up
