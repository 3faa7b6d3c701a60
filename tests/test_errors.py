"""Unsupported inputs fail early with a ValueError that names the fix (tiny random Llama, no downloads)."""

from __future__ import annotations

import pytest
import torch

import hf_adaspec
from hf_adaspec import CostTable
from hf_adaspec.config import SpeculationConfig

pytestmark = pytest.mark.usefixtures("one_thread")
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
PROMPT = torch.tensor([[3, 4, 5, 3, 4, 5]])  # [1, 6]


@pytest.fixture(scope="module")
def target(tiny_factory):
    return hf_adaspec.enable(tiny_factory(0))


def _generate(model, input_ids=PROMPT, **kwargs):
    kwargs.setdefault("speculation_costs", COSTS)
    kwargs.setdefault("do_sample", False)
    return model.generate(input_ids, max_new_tokens=5, **kwargs)


@pytest.mark.parametrize("value", ["adaptiv", "greedy", "Adaptive", ""])
def test_unknown_speculation_value(target, value):
    with pytest.raises(ValueError, match="adaptive"):
        _generate(target, speculation=value)


@pytest.mark.parametrize("mode", ["hybrid", "confidence", "pmin", "hybrid-confidence"])
def test_mode_needs_a_draft_model(target, mode):
    with pytest.raises(ValueError, match="assistant_model") as err:
        _generate(target, speculation=mode)
    assert mode in str(err.value)


@pytest.mark.parametrize("kwargs, message", [({"speculation": "pmin"}, "batch size 1"),
                                             ({"speculation": "hybrid-confidence"}, "batch size 1"),
                                             ({"speculation": "adaptive", "tpot_slo_ms": 50.0}, "tpot_slo_ms")])
def test_single_request_modes_and_slo_reject_batches(target, tiny_factory, kwargs, message):
    batch = torch.cat([PROMPT, PROMPT])  # [2, 6]
    with pytest.raises(ValueError, match=message):
        _generate(target, batch, assistant_model=tiny_factory(1), **kwargs)


def test_fixed_needs_num_speculative_tokens(target):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _generate(target, speculation="fixed")


def test_negative_num_speculative_tokens(target):
    with pytest.raises(ValueError, match=">= 0"):
        _generate(target, speculation="fixed", num_speculative_tokens=-1)


def test_right_padded_prompt_is_rejected(target):
    mask = torch.ones_like(PROMPT)
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="left padding"):
        _generate(target, speculation="adaptive", attention_mask=mask)


def test_draft_with_other_vocabulary(target, tiny_factory):
    draft = tiny_factory(1, vocab_size=80)
    with pytest.raises(ValueError, match="vocabulary") as err:
        _generate(target, speculation="adaptive", assistant_model=draft)
    assert "80" in str(err.value) and "64" in str(err.value)


@pytest.mark.parametrize("kwargs", [{"num_beams": 2}, {"num_return_sequences": 2, "do_sample": True}])
def test_beam_search_and_multiple_sequences_are_rejected(target, kwargs):
    with pytest.raises(ValueError, match="num_beams"):
        _generate(target, speculation="adaptive", **kwargs)


def test_output_scores_is_rejected(target):
    with pytest.raises(ValueError, match="scores"):
        _generate(target, speculation="adaptive", output_scores=True, return_dict_in_generate=True)


def test_valid_call_still_works_after_errors(target):
    out = _generate(target, speculation="adaptive")
    assert out.shape == (1, PROMPT.shape[1] + 5)


@pytest.mark.parametrize(
    "kwargs",
    [{"min_gain": -0.1}, {"max_speculative_tokens": 0}, {"speculation": "fixed", "num_speculative_tokens": -2},
     {"speculation": "pmin", "draft_p_min": 1.5}, {"tpot_slo_ms": -1.0}],
)
def test_speculation_config_validation(kwargs):
    with pytest.raises(ValueError):
        SpeculationConfig(**kwargs)


def test_speculation_config_k_max():
    assert SpeculationConfig().k_max == 8
    assert SpeculationConfig(max_speculative_tokens=4).k_max == 4
    assert SpeculationConfig(speculation="fixed", num_speculative_tokens=3).k_max == 3


def test_load_rejects_unknown_quantization():
    with pytest.raises(ValueError, match="nf5"):
        hf_adaspec.load("smollm2-135m", quantization="nf5")


def test_load_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="float8"):
        hf_adaspec.load("smollm2-135m", quantization="none", dtype="float8")


def test_every_generate_config_keyword_is_a_config_field():
    import dataclasses

    from hf_adaspec.integration import _CONFIG_KEYWORDS

    fields = {f.name for f in dataclasses.fields(SpeculationConfig)}
    assert set(_CONFIG_KEYWORDS) <= fields - {"speculation"}
    assert {"learn_horizon", "alpha_prior_quantile"} <= set(_CONFIG_KEYWORDS)
