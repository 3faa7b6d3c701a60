"""The horizon (tokens still to come) over which a draft's catch-up is amortised, learned per model."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

import hf_adaspec
from hf_adaspec import CostTable
from hf_adaspec.engine import DecodeSettings
from hf_adaspec.horizon import LengthMemory, expected_remaining, lindy_horizon

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]
# α = 1 draft at 1 ms/token, 10 ms/verify, 1 ms per token of catch-up: ingesting the 24-token prompt
# pays over a horizon of ≥ 4 tokens, not over 1 (horizon_goodput against a 100 tokens/s plain step).
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


def test_expected_remaining_quantile_by_hand():
    lengths = [3, 10, 20, 64, 64]
    assert expected_remaining(5, 59, lengths, quantile=0.25) == 5  # of 5, 15, 59, 59: nearest rank 1
    assert expected_remaining(5, 59, lengths, quantile=0.5) == 15
    assert expected_remaining(5, 59, lengths, quantile=1.0) == 59
    assert expected_remaining(5, 10, lengths, quantile=0.75) == 10  # capped by tokens left
    assert expected_remaining(64, 10, lengths, quantile=0.5) is None
    with pytest.raises(ValueError, match=r"quantile must be in \[0, 1\]"):
        expected_remaining(5, 59, lengths, quantile=1.5)


def test_length_memory_falls_back_to_lindy_and_keeps_the_last_requests():
    memory = LengthMemory(size=2)
    assert memory.horizon(3, 50) == 3  # no history: as many as so far
    memory.record(40)
    assert memory.horizon(3, 50) == 37
    assert memory.horizon(3, 10) == 10  # never past the tokens left
    assert memory.horizon(39, 50) == 1
    assert memory.horizon(45, 50) == 45  # nothing ran this long: lindy again
    assert memory.horizon(45, 50, quantile=0.25) == 45
    memory.record(4)
    memory.record(5)
    assert list(memory.lengths) == [4, 5]
    with pytest.raises(ValueError, match=">= 0"):
        memory.record(-1)
    with pytest.raises(ValueError, match="size"):
        LengthMemory(size=0)


def test_engine_asks_the_settings_horizon_with_generated_and_tokens_left(models):
    calls = []

    def horizon(generated, tokens_left):
        calls.append((generated, tokens_left))
        return tokens_left

    request = hf_adaspec.integration.SpeculationRequest(hf_adaspec.SpeculationConfig("adaptive"), models["same_model"],
                                                        costs=COSTS)
    stop = StoppingCriteriaList([MaxLengthCriteria(24 + 12)])
    settings = DecodeSettings(LogitsProcessorList(), stop, 24 + 12, False, 8, horizon=horizon)
    proposers = hf_adaspec.integration._build_proposers(request, LogitsProcessorList(),
                                                        models["target"].generation_config)
    controller = hf_adaspec.modes.build_controller(models["target"], request, proposers, 24)
    hf_adaspec.engine.speculative_decode(models["target"], PROMPT, proposers, controller, settings)
    assert calls[0] == (1, 11)  # after the prefill's token: 1 generated, 11 of 12 left
    assert all(g + left == 12 for g, left in calls)


def test_a_model_that_ran_long_requests_drafts_from_the_first_step(tiny_factory):
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(0)

    def first_k(**kwargs):  # the same prompt each time: no draft prefix reuse, or it would cost no catch-up
        out = target.generate(PROMPT, assistant_model=draft, speculation="adaptive", speculation_costs=COSTS,
                              max_new_tokens=40, do_sample=False, return_dict_in_generate=True,
                              reuse_draft_prefix=False, **kwargs)
        return out.speculation.steps[0].k

    assert first_k() == 0  # no history: a horizon of 1 token does not pay the prompt's catch-up
    assert first_k() > 0  # the last request ran 40 tokens: this one is expected to as well
    assert first_k(learn_horizon=False) == 0  # the ablation: as many tokens as so far


def test_a_hedged_horizon_waits_where_some_past_requests_were_short(tiny_factory):
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(0)

    def first_k(**kwargs):
        state = hf_adaspec.SpeculationState()
        for length in (3, 40, 40, 40):  # one short answer among long ones
            state.lengths.record(length)
        out = target.generate(PROMPT, assistant_model=draft, speculation="adaptive", speculation_costs=COSTS,
                              max_new_tokens=40, do_sample=False, return_dict_in_generate=True,
                              speculation_state=state, **kwargs)
        return out.speculation.steps[0].k

    assert first_k() > 0  # the mean remaining length (about 30 tokens) pays the prompt's catch-up
    assert first_k(horizon_quantile=0.25) == 0  # its lower quartile (2 tokens) does not
    assert first_k(horizon_quantile=0.75) > 0
    with pytest.raises(ValueError, match="horizon_quantile must be in"):
        first_k(horizon_quantile=-0.1)


def test_bench_sofar_methods_turn_the_learned_horizon_off():
    from hf_adaspec.bench import METHOD_FAMILY, method_kwargs

    for mode in ("adaptive", "hybrid", "confidence"):
        assert method_kwargs(f"{mode}-sofar", "d", 5) == {**method_kwargs(mode, "d", 5), "learn_horizon": False}
        assert METHOD_FAMILY[f"{mode}-sofar"] == METHOD_FAMILY[mode]
    for mode in ("confidence", "hybrid-confidence"):
        assert method_kwargs(f"{mode}-hedged", "d", 5) == {**method_kwargs(mode, "d", 5), "horizon_quantile": 0.25}
        assert METHOD_FAMILY[f"{mode}-hedged"] == METHOD_FAMILY[mode]
