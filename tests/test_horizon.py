"""The horizon (tokens still to come) over which a draft's catch-up is amortised."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

import hf_adaspec
from hf_adaspec import CostTable
from hf_adaspec.backend.ragged import RaggedCache
from hf_adaspec.engine.loop import speculative_decode
from hf_adaspec.engine.settings import DecodeSettings, RunParts
from hf_adaspec.policy.controller import FixedController, StepView
from hf_adaspec.policy.horizon import lindy_horizon
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


class _Spy(FixedController):
    """A fixed-k controller that keeps every StepView it is shown."""

    def __init__(self, k: int) -> None:
        super().__init__(k)
        self.views: list[StepView] = []

    def decide(self, batch: int, view: Callable[[], StepView]):
        self.views.append(view())
        return super().decide(batch, view)


def test_engine_asks_the_settings_horizon_with_generated_and_tokens_left(models):
    calls = []

    def horizon(generated, tokens_left):
        calls.append((generated, tokens_left))
        return 1000 + generated

    stop = StoppingCriteriaList([MaxLengthCriteria(24 + 12)])
    settings = DecodeSettings(LogitsProcessorList(), stop, 24 + 12, False, horizon=horizon)
    controller = _Spy(2)
    parts = RunParts(RaggedCache(models["target"], 1), (PromptLookupProposer(),), controller, settings, 8)
    speculative_decode(parts, PROMPT, torch.ones_like(PROMPT))
    assert calls[0] == (1, 11)  # after the prefill's token: 1 generated, 11 of 12 left
    assert all(g + left == 12 for g, left in calls) and len(calls) == len(controller.views)
    assert [v.horizon for v in controller.views] == [1000 + g for g, _ in calls]  # what the controller sees


def _first_k(target, draft) -> int:
    """k of the first step of a fresh request (no prompt prefix to reuse)."""
    out = target.generate(
        PROMPT,
        assistant_model=draft,
        speculation="adaptive",
        speculation_costs=COSTS,
        max_new_tokens=40,
        do_sample=False,
        return_dict_in_generate=True,
        speculation_state=hf_adaspec.SpeculationState(),
        max_slowdown=math.inf,
    )  # goodput alone
    return out.speculation.steps[0].k, out.speculation


def test_the_draft_pays_its_catch_up_once_the_request_has_run_long_enough(tiny_factory):
    """Over a horizon of 1 token the 24-token prompt's catch-up cannot pay: the first step is not the
    draft's; as the request runs on (horizon = tokens so far) the draft joins."""
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(0)
    k, stats = _first_k(target, draft)
    assert k == 0 or stats.steps[0].drafter != "draft_model"
    assert any(s.drafter == "draft_model" for s in stats.steps)
