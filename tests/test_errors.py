"""Unsupported inputs fail early, through ``generate``, with a ValueError that names the fix (tiny random
Llama, no downloads)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import single_thread
from transformers import GenerationConfig
from transformers.generation.streamers import BaseStreamer

import hf_adaspec
from hf_adaspec import CostTable, SpeculationState
from hf_adaspec.config import SpeculationConfig

pytestmark = pytest.mark.usefixtures("one_thread")
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
PROMPT = torch.tensor([[3, 4, 5, 3, 4, 5]])  # [1, 6]
BATCH = {
    "input_ids": torch.tensor([[0, 0, 3, 4, 5, 6], [3, 4, 5, 3, 4, 5]]),  # [2, 6], row 0 left-padded
    "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]]),
}


@pytest.fixture(scope="module")
def target(tiny_factory):
    with single_thread():  # the model's own thread chooser follows torch's count at enable; one_thread comes later
        return hf_adaspec.enable(tiny_factory(0))


def _generate(model, input_ids=PROMPT, **kwargs):
    kwargs.setdefault("speculation_costs", COSTS)
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("max_new_tokens", 5)
    return model.generate(input_ids, **kwargs)


class _NullStreamer(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


# --- the modes ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value", ["adaptiv", "greedy", "Adaptive", "", "hybrid", "confidence", "pmin", "hybrid-confidence"]
)
def test_unknown_speculation_value_lists_the_modes(target, value):
    with pytest.raises(ValueError, match="is not supported") as err:
        _generate(target, speculation=value)
    assert "'adaptive'" in str(err.value) and "'fixed'" in str(err.value)


def test_fixed_needs_num_speculative_tokens(target):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _generate(target, speculation="fixed")


@pytest.mark.parametrize("kwargs", [{"num_speculative_tokens": 3}, {"draft_p_min": 0.75}])
def test_fixed_only_settings_with_adaptive(target, kwargs):
    with pytest.raises(ValueError, match='belong to speculation="fixed"'):
        _generate(target, speculation="adaptive", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"speculation": "fixed", "num_speculative_tokens": 65},
            r"num_speculative_tokens must be in \[0, 64\], got 65",
        ),
        (
            {"speculation": "fixed", "num_speculative_tokens": -1},
            r"num_speculative_tokens must be in \[0, 64\], got -1",
        ),
        ({"speculation": "adaptive", "max_speculative_tokens": 65}, r"max_speculative_tokens must be in \[1, 64\]"),
        ({"speculation": "adaptive", "max_speculative_tokens": 0}, r"max_speculative_tokens must be in \[1, 64\]"),
        ({"speculation": "adaptive", "prompt_lookup_max_ngram": 0}, "prompt_lookup_max_ngram must be >= 1"),
        ({"speculation": "adaptive", "tpot_slo_ms": -1.0}, "tpot_slo_ms must be > 0"),
        ({"speculation": "fixed", "num_speculative_tokens": 8, "draft_p_min": 1.5}, r"draft_p_min must be in \[0, 1\]"),
    ],
)
def test_out_of_range_settings(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _generate(target, **kwargs)


def test_every_config_field_is_a_generate_keyword(target):
    """Each SpeculationConfig field (but ``speculation``) reaches the config from generate: an invalid value
    raises the config's error naming that field (a field generate dropped would not raise)."""
    invalid = {
        "num_speculative_tokens": {"speculation": "fixed", "num_speculative_tokens": 99},
        "max_speculative_tokens": {"speculation": "adaptive", "max_speculative_tokens": 99},
        "prompt_lookup_max_ngram": {"speculation": "adaptive", "prompt_lookup_max_ngram": -3},
        "tpot_slo_ms": {"speculation": "adaptive", "tpot_slo_ms": 0.0},
        "draft_p_min": {"speculation": "fixed", "num_speculative_tokens": 2, "draft_p_min": -0.5},
        "adapt_threads": {"speculation": "adaptive", "adapt_threads": "yes"},
        "rest": {"speculation": "adaptive", "rest": 1},
        "max_slowdown": {"speculation": "adaptive", "max_slowdown": -0.1},
        "kv_cache": {"speculation": "adaptive", "kv_cache": "paged"},
    }
    assert set(invalid) == {f.name for f in dataclasses.fields(SpeculationConfig)} - {"speculation"}
    for name, kwargs in invalid.items():
        with pytest.raises(ValueError, match=name):
            _generate(target, **kwargs)


def test_speculation_state_without_speculation(target):
    with pytest.raises(ValueError, match="speculation_state"):
        target.generate(PROMPT, max_new_tokens=2, speculation_state=hf_adaspec.SpeculationState())


# --- the inputs -----------------------------------------------------------------------------------------


def test_right_padded_prompt_is_rejected(target):
    mask = torch.ones_like(PROMPT)
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        _generate(target, speculation="adaptive", attention_mask=mask)
    right = {"input_ids": BATCH["input_ids"].flip(1), "attention_mask": BATCH["attention_mask"].flip(1)}
    with pytest.raises(ValueError, match="right-padded"):
        _generate(target, right["input_ids"], attention_mask=right["attention_mask"], speculation="adaptive")


def test_empty_prompt_is_rejected(target):
    mask = BATCH["attention_mask"].clone()
    mask[1] = 0
    with pytest.raises(ValueError, match=r"prompt\(s\) \[1\] of the batch are empty"):
        _generate(target, BATCH["input_ids"], attention_mask=mask, speculation="adaptive")


@pytest.mark.parametrize("padded_single", [False, True])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"streamer": _NullStreamer()}, "streamer and speculation_callback support batch size 1"),
        (
            {"speculation_callback": lambda record, tokens: None},
            "streamer and speculation_callback support batch size 1",
        ),
        ({"tpot_slo_ms": 50.0}, "tpot_slo_ms supports batch size 1"),
    ],
)
def test_batch_size_1_features_reject_batches(target, tiny_factory, kwargs, message, padded_single):
    """A batch is B > 1 or a padded prompt; with or without a draft model."""
    ids, mask = BATCH["input_ids"], BATCH["attention_mask"]
    if padded_single:
        ids, mask = ids[:1], mask[:1]
    for draft in ({}, {"assistant_model": tiny_factory(1)}):
        with pytest.raises(ValueError, match=message):
            _generate(target, ids, attention_mask=mask, speculation="adaptive", **draft, **kwargs)


def test_draft_with_other_vocabulary(target, tiny_factory):
    draft = tiny_factory(1, vocab_size=80)
    for mode in ({"speculation": "adaptive"}, {"speculation": "fixed", "num_speculative_tokens": 2}):
        with pytest.raises(ValueError, match="vocabulary") as err:
            _generate(target, assistant_model=draft, **mode)
        assert "80" in str(err.value) and "64" in str(err.value)


@pytest.mark.parametrize("kwargs", [{"num_beams": 2}, {"num_return_sequences": 2, "do_sample": True}])
def test_beam_search_and_multiple_sequences_are_rejected(target, kwargs):
    with pytest.raises(ValueError, match="num_beams"):
        _generate(target, speculation="adaptive", **kwargs)


def test_output_scores_is_rejected(target):
    with pytest.raises(ValueError, match="scores"):
        _generate(target, speculation="adaptive", output_scores=True, return_dict_in_generate=True)


def test_token_healing_is_rejected(target):
    with pytest.raises(ValueError, match="does not support token_healing"):
        _generate(target, speculation="adaptive", token_healing=True)
    with pytest.raises(ValueError, match="does not support token_healing"):
        _generate(target, speculation="adaptive", generation_config=GenerationConfig(token_healing=True))


@pytest.mark.parametrize("flag", ["output_scores", "output_logits", "output_attentions", "output_hidden_states"])
def test_per_step_outputs_are_rejected_by_name(target, flag):
    for extra in ({}, {"return_dict_in_generate": True}):
        with pytest.raises(ValueError, match=f"drop {flag}=True") as err:
            _generate(target, speculation="adaptive", **{flag: True}, **extra)
        assert err.value.args[0].count("=True") == 1  # only the flag that was set


ASSISTED = {
    "prompt_lookup_num_tokens": 3,
    "max_matching_ngram_size": 2,
    "num_assistant_tokens": 5,
    "num_assistant_tokens_schedule": "heuristic",
    "assistant_confidence_threshold": 0.3,
    "assistant_early_exit": 1,
    "assistant_lookbehind": 5,
    "target_lookbehind": 5,
    "use_mtp": True,
}


def _assert_names_the_equivalents(err, name):
    message = str(err.value)
    assert name in message and "transformers' assisted generation" in message
    for ours in ("max_speculative_tokens", "prompt_lookup_max_ngram", 'speculation="fixed"', "num_speculative_tokens"):
        assert ours in message


@pytest.mark.parametrize("name", [*ASSISTED, "assistant_tokenizer"])
def test_transformers_assisted_options_are_rejected_as_keywords(target, tiny_factory, name):
    value = ASSISTED.get(name, object())  # assistant_tokenizer: any tokenizer-like object
    for mode in (
        {"speculation": "adaptive"},
        {"speculation": "fixed", "num_speculative_tokens": 2, "assistant_model": tiny_factory(1)},
    ):
        with pytest.raises(ValueError, match="belong to transformers' assisted generation") as err:
            _generate(target, **mode, **{name: value})
        _assert_names_the_equivalents(err, name)


@pytest.mark.parametrize("name", list(ASSISTED))
def test_transformers_assisted_options_are_rejected_on_a_generation_config(target, name):
    config = GenerationConfig(max_new_tokens=5, do_sample=False, **{name: ASSISTED[name]})
    with pytest.raises(ValueError, match="belong to transformers' assisted generation") as err:
        target.generate(PROMPT, generation_config=config, speculation="adaptive", speculation_costs=COSTS)
    _assert_names_the_equivalents(err, name)


def test_transformers_assisted_options_still_work_without_speculation(target):
    plain = target.generate(PROMPT, max_new_tokens=5, do_sample=False)
    assert torch.equal(target.generate(PROMPT, max_new_tokens=5, do_sample=False, prompt_lookup_num_tokens=3), plain)


@pytest.mark.parametrize("ids", [torch.zeros(1, 0, dtype=torch.long), torch.zeros(0, dtype=torch.long)])
@pytest.mark.parametrize("as_keyword", [False, True])
def test_a_prompt_without_tokens_names_the_fix(target, tiny_factory, ids, as_keyword):
    for mode in (
        {"speculation": "adaptive"},
        {"speculation": "adaptive", "assistant_model": tiny_factory(1)},
        {"speculation": "fixed", "num_speculative_tokens": 2},
    ):
        with pytest.raises(ValueError, match="the prompt has no tokens") as err:
            if as_keyword:
                target.generate(input_ids=ids, max_new_tokens=5, speculation_costs=COSTS, **mode)
            else:
                _generate(target, ids, **mode)
        assert "add_special_tokens=True" in str(err.value)


def test_valid_calls_still_work_after_errors(target):
    assert _generate(target, speculation="adaptive").shape == (1, PROMPT.shape[1] + 5)
    out = _generate(
        target,
        BATCH["input_ids"],
        attention_mask=BATCH["attention_mask"],
        speculation="fixed",
        num_speculative_tokens=64,
    )  # the top of the range is allowed
    assert out.shape == (2, 6 + 5)


# --- SpeculationConfig and load -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_speculative_tokens": 0},
        {"max_speculative_tokens": 65},
        {"speculation": "fixed"},
        {"speculation": "fixed", "num_speculative_tokens": -2},
        {"speculation": "fixed", "num_speculative_tokens": 65},
        {"speculation": "fixed", "num_speculative_tokens": 4, "draft_p_min": 1.5},
        {"draft_p_min": 0.5},
        {"num_speculative_tokens": 4},
        {"tpot_slo_ms": -1.0},
        {"tpot_slo_ms": 0.0},
        {"prompt_lookup_max_ngram": 0},
        {"speculation": "pmin"},
    ],
)
def test_speculation_config_validation(kwargs):
    with pytest.raises(ValueError):
        SpeculationConfig(**kwargs)


def test_speculation_config_k_max_and_modes():
    assert hf_adaspec.SPECULATION_MODES == ("adaptive", "fixed")
    assert SpeculationConfig().k_max == 8
    assert SpeculationConfig(max_speculative_tokens=4).k_max == 4
    assert SpeculationConfig(speculation="fixed", num_speculative_tokens=3).k_max == 3
    assert SpeculationConfig(speculation="fixed", num_speculative_tokens=0).k_max == 0
    assert SpeculationConfig(speculation="fixed", num_speculative_tokens=64, draft_p_min=0.0).k_max == 64


def test_load_rejects_unknown_quantization():
    with pytest.raises(ValueError, match="nf5"):
        hf_adaspec.load("smollm2-135m", quantization="nf5")


def test_load_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="float8"):
        hf_adaspec.load("smollm2-135m", quantization="none", dtype="float8")


# --- a proposal length or a count is an integer (issue 37) ---------------------------------------------

NOT_INTEGERS = [8.5, 8.0, True, "8"]


@pytest.mark.parametrize("value", NOT_INTEGERS)
@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("max_speculative_tokens", "adaptive"),
        ("num_speculative_tokens", "fixed"),
        ("prompt_lookup_max_ngram", "adaptive"),
    ],
)
def test_a_non_integer_k_is_refused_through_generate(target, name, mode, value):
    with pytest.raises(ValueError, match=f"{name} must be an integer"):
        _generate(target, speculation=mode, **{name: value})


@pytest.mark.parametrize("value", NOT_INTEGERS)
def test_generate_batch_refuses_non_integer_counts(target, value):
    from conftest import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        hf_adaspec.generate_batch(target, tokenizer, ["w1 w2 w3"], max_new_tokens=value, speculation_costs=COSTS)
    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
        hf_adaspec.generate_batch(
            target,
            tokenizer,
            ["w1 w2 w3"],
            speculation="fixed",
            num_speculative_tokens=value,
            max_new_tokens=2,
            speculation_costs=COSTS,
        )
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        hf_adaspec.generate_batch(target, tokenizer, ["w1 w2 w3"], max_new_tokens=0)


@pytest.mark.parametrize("value", NOT_INTEGERS)
def test_fixed_controller_refuses_a_non_integer_k_or_batch(value):
    from hf_adaspec.policy.controller import FixedController

    with pytest.raises(ValueError, match="num_speculative_tokens must be an integer"):
        FixedController(value)
    with pytest.raises(ValueError, match="batch must be an integer"):
        FixedController(3, batch=value)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        FixedController(3, batch=0)
    assert FixedController(0).k == 0


@pytest.mark.parametrize("value", NOT_INTEGERS)
def test_playground_settings_refuse_a_non_integer_k_or_length(value):
    from hf_adaspec.playground.live import RunSettings

    with pytest.raises(ValueError, match="k must be an integer"):
        RunSettings("fixed", k=value)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
        RunSettings("fixed", max_new_tokens=value)
    with pytest.raises(ValueError, match=r"k must be in \[1, 64\]"):
        RunSettings("fixed", k=65)
    assert RunSettings("fixed", k=64).k == 64


def test_a_draft_with_a_narrower_head_drafts_for_the_target(target, tiny_factory):
    """The same tokenizer with the target's output head padded (Qwen2.5-7B's 152,064 rows against the
    0.5B's 151,936): the draft's logits are padded with −inf, ids beyond its own are never proposed, and a
    target id it cannot embed is fed to it as its last id; greedy output stays the target's."""
    draft = tiny_factory(0, vocab_size=48)
    prompt = torch.tensor([[5, 6, 7, 50, 8, 9, 60] * 3])  # ids 50 and 60 lie beyond the draft's vocabulary
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    out = target.generate(
        prompt,
        assistant_model=draft,
        speculation="fixed",
        num_speculative_tokens=3,
        speculation_costs=COSTS,
        speculation_state=SpeculationState(),
        max_new_tokens=20,
        do_sample=False,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    assert {s.drafter for s in out.speculation.steps if s.k} == {"draft_model"}
