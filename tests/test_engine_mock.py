"""The speculative loop at batch size 1 through ``model.generate`` on tiny random Llamas (no downloads):
what each mode drafts, the budget, EOS, the streamer and the step callback, sampling, calibration.

fp32 tiny models are shape-stable, so greedy speculative output must equal plain greedy token for token
(the mode × drafter × batch matrix of that invariant is in test_invariants.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import slow_except
from transformers.generation.streamers import BaseStreamer

import hf_adaspec
import hf_adaspec.costs.cache as cost_cache
from hf_adaspec import (
    CostTable,
    SpeculationState,
    SpeculationStats,
    SpeculativeGenerateOutput,
)

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # passing costs skips calibration
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24], repetitive so prompt lookup proposes
DRAFTERS = ["other_seed", "noisy_copy", "same_model", "prompt_lookup"]


def _plain(models, **kwargs) -> torch.Tensor:
    return models["target"].generate(PROMPT, do_sample=False, **kwargs)


def _spec(models, drafter: str, **kwargs):
    draft = {} if drafter == "prompt_lookup" else {"assistant_model": models[drafter]}
    kwargs.setdefault("speculation", "adaptive")
    kwargs.setdefault("speculation_costs", COSTS)
    kwargs.setdefault("speculation_state", SpeculationState())
    kwargs.setdefault("do_sample", False)
    kwargs.setdefault("rest", False)  # decide every step: which steps rest depends on a decision's measured time
    return models["target"].generate(PROMPT, **draft, **kwargs)


def test_adaptive_output_and_stats(models):
    plain = _plain(models, max_new_tokens=30)
    out = _spec(models, "noisy_copy", max_new_tokens=30, return_dict_in_generate=True)
    assert isinstance(out, SpeculativeGenerateOutput) and isinstance(out.speculation, SpeculationStats)
    assert torch.equal(out.sequences, plain)  # [1, 24 + 30]
    stats = out.speculation
    assert stats.new_tokens == 30 == plain.shape[1] - PROMPT.shape[1]
    assert sum(stats.k_histogram.values()) == len(stats.steps) > 0
    assert sum(s.emitted for s in stats.steps) == 29  # the prefill emits the first token
    assert any(s.k > 0 for s in stats.steps)
    assert all(s.alpha == s.alpha for s in stats.steps if s.decided)  # adaptive predicts α for each decision


def test_adaptive_with_a_draft_model_also_uses_prompt_lookup(models):
    """The draft agrees almost never (α ≈ 0) but the prompt repeats: adaptive lets prompt lookup and plain
    steps compete with the draft model every step."""
    out = _spec(models, "other_seed", max_new_tokens=30, return_dict_in_generate=True)
    assert torch.equal(out.sequences, _plain(models, max_new_tokens=30))
    assert {"draft_model", "prompt_lookup"} <= {s.drafter for s in out.speculation.steps}


def test_fixed_uses_only_the_draft_model_when_given(models):
    out = _spec(
        models,
        "other_seed",
        max_new_tokens=20,
        speculation="fixed",
        num_speculative_tokens=2,
        return_dict_in_generate=True,
    )
    assert {s.drafter for s in out.speculation.steps if s.k} == {"draft_model"}  # no prompt lookup beside it


# the fast suite keeps adaptive's case (mode0); fixed's is slow
@pytest.mark.parametrize(
    "mode",
    [
        {"speculation": "adaptive"},
        pytest.param({"speculation": "fixed", "num_speculative_tokens": 3}, marks=pytest.mark.slow),
    ],
)
def test_identical_draft_is_always_accepted(models, mode):
    out = _spec(models, "same_model", max_new_tokens=30, return_dict_in_generate=True, **mode)
    assert torch.equal(out.sequences, _plain(models, max_new_tokens=30))
    drafted = [s for s in out.speculation.steps if s.drafter == "draft_model"]
    assert drafted and all(s.accepted == s.k for s in drafted)  # every draft token accepted (bonus path)


def test_partial_agreement_is_partly_accepted(models):
    rate = _spec(
        models,
        "noisy_copy",
        max_new_tokens=30,
        speculation="fixed",
        num_speculative_tokens=3,
        return_dict_in_generate=True,
    ).speculation.acceptance_rate
    assert 0 < rate < 1


# the fast suite keeps 1-noisy_copy (a draft model's k checked step by step); the rest is slow
@pytest.mark.parametrize("drafter", slow_except(["noisy_copy", "prompt_lookup"], fast={"noisy_copy"}))
@pytest.mark.parametrize("k", slow_except([1, 8], fast={1}))
def test_fixed_k_greedy_equals_plain(models, drafter, k):
    out = _spec(
        models, drafter, max_new_tokens=30, speculation="fixed", num_speculative_tokens=k, return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, _plain(models, max_new_tokens=30))
    assert max(out.speculation.k_histogram) <= k
    if drafter == "noisy_copy":  # a draft model always offers k, capped by the tokens left in the budget
        emitted = 1  # by the prefill
        for step in out.speculation.steps:
            assert step.k == min(k, 30 - emitted - 1)  # k drafts + 1 bonus must fit
            emitted += step.emitted


def test_fixed_k0_is_plain_decoding(models):
    out = _spec(
        models,
        "noisy_copy",
        max_new_tokens=12,
        speculation="fixed",
        num_speculative_tokens=0,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, _plain(models, max_new_tokens=12))
    assert out.speculation.k_histogram == {0: 11}


# the fast suite keeps 1.0-one (both runs it makes, 1 and 0.75, stop drafting); 0.0-all is slow
@pytest.mark.parametrize(("p_min", "expected_k"), [pytest.param(0.0, "all", marks=pytest.mark.slow), (1.0, "one")])
def test_draft_p_min_stops_drafting(models, p_min, expected_k):
    """draft_p_min = 0 never stops (always k = 8, capped by the budget); 1 stops after the first drafted token
    (every q(x) < 1); 0.75, the llama.cpp default, stops in between."""

    def steps(p):
        out = _spec(
            models,
            "noisy_copy",
            max_new_tokens=30,
            speculation="fixed",
            num_speculative_tokens=8,
            draft_p_min=p,
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, _plain(models, max_new_tokens=30))
        return out.speculation.steps

    emitted, ks = 1, []
    for step in steps(p_min):
        ks.append((step.k, min(8, 30 - emitted - 1)))
        emitted += step.emitted
    assert all(k == (cap if expected_k == "all" else min(1, cap)) for k, cap in ks)
    middle = [s.k for s in steps(0.75)]
    assert max(middle) > 1 and any(1 <= k < 8 for k in middle[:-2])


@pytest.mark.parametrize("drafter", ["noisy_copy", "same_model", "prompt_lookup"])
@pytest.mark.parametrize("max_new_tokens", slow_except([1, 2, 5, 13], fast={1, 2, 5}))  # 13 (the dearest): slow
def test_max_new_tokens_honoured_exactly(models, drafter, max_new_tokens):
    out = _spec(models, drafter, max_new_tokens=max_new_tokens, speculation="fixed", num_speculative_tokens=8)
    assert out.shape == (1, PROMPT.shape[1] + max_new_tokens)
    assert torch.equal(out, _plain(models, max_new_tokens=max_new_tokens))


# the fast suite keeps noisy_copy (a draft model with rejections); the other drafters are slow
@pytest.mark.parametrize("drafter", slow_except(DRAFTERS, fast={"noisy_copy"}))
def test_eos_stops_like_plain(models, drafter):
    generated = _plain(models, max_new_tokens=40)[0, PROMPT.shape[1] :].tolist()
    eos = generated[15]
    stop_at = generated.index(eos)  # plain stops at the first occurrence
    plain = _plain(models, max_new_tokens=40, eos_token_id=eos)
    assert plain.shape[1] == PROMPT.shape[1] + stop_at + 1 < PROMPT.shape[1] + 40
    assert plain[0, -1].item() == eos
    out = _spec(models, drafter, max_new_tokens=40, eos_token_id=eos)
    assert torch.equal(out, plain)


class _Collect(BaseStreamer):
    def __init__(self) -> None:
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ended += 1


# the fast suite keeps prompt lookup's case; the draft model's is slow
@pytest.mark.parametrize("drafter", slow_except(["noisy_copy", "prompt_lookup"], fast={"prompt_lookup"}))
def test_streamer_receives_exactly_the_generated_tokens(models, drafter):
    streamer = _Collect()
    out = _spec(models, drafter, max_new_tokens=30, streamer=streamer)
    assert streamer.puts[0] == PROMPT[0].tolist()  # generate itself puts the prompt first
    streamed = [tok for chunk in streamer.puts[1:] for tok in chunk]
    assert streamed == out[0, PROMPT.shape[1] :].tolist()
    assert streamer.ended == 1
    assert any(len(chunk) > 1 for chunk in streamer.puts[1:])  # multi-token steps arrive as one chunk


# the fast suite keeps prompt lookup's case; the draft model's is slow
@pytest.mark.parametrize("drafter", slow_except(["noisy_copy", "prompt_lookup"], fast={"prompt_lookup"}))
def test_step_callback_sees_every_token_with_its_source(models, drafter):
    events = []
    out = _spec(
        models,
        drafter,
        max_new_tokens=30,
        return_dict_in_generate=True,
        speculation_callback=lambda record, tokens: events.append((record, tokens.tolist())),
    )
    assert events[0][0] is None and len(events[0][1]) == 1  # the prefill's token
    assert [r for r, _ in events[1:]] == out.speculation.steps
    streamed = [t for _, tokens in events for t in tokens]
    assert streamed == out.sequences[0, PROMPT.shape[1] :].tolist()
    sources = [s for record, _ in events[1:] for s in record.token_sources()]
    assert len(sources) == 29 and "correction" in sources
    name = "draft_model" if drafter == "noisy_copy" else "prompt_lookup"
    assert set(sources) <= {"draft_model", "prompt_lookup", "suffix", "bonus", "correction", "plain"}
    assert name in sources or drafter == "prompt_lookup" and "suffix" in sources
    for record, tokens in events[1:]:
        assert len(record.token_sources()) == len(tokens) == record.emitted


def test_sampling_with_top_k_1_equals_greedy(models):
    # top_k=1 makes p and q one-hot: the speculative-sampling path must reproduce greedy output
    out = _spec(models, "noisy_copy", max_new_tokens=30, do_sample=True, top_k=1, return_dict_in_generate=True)
    assert torch.equal(out.sequences, _plain(models, max_new_tokens=30))
    assert any(s.k > 0 for s in out.speculation.steps)


# the fast suite keeps prompt lookup's case; the draft model's is slow
@pytest.mark.parametrize("drafter", slow_except(["noisy_copy", "prompt_lookup"], fast={"prompt_lookup"}))
def test_sampling_runs_and_respects_budget(models, drafter):
    torch.manual_seed(0)
    out = _spec(models, drafter, max_new_tokens=25, do_sample=True, return_dict_in_generate=True)
    assert out.sequences.shape == (1, PROMPT.shape[1] + 25)
    assert torch.equal(out.sequences[:, : PROMPT.shape[1]], PROMPT)
    assert out.speculation.new_tokens == 25 and any(s.k > 0 for s in out.speculation.steps)


def test_without_speculation_generate_is_unchanged(models, tiny_factory):
    fresh = tiny_factory(0)  # never enabled
    expected = fresh.generate(PROMPT, max_new_tokens=20, do_sample=False)
    assert torch.equal(_plain(models, max_new_tokens=20), expected)
    assert hf_adaspec.enable(models["target"]) is models["target"]  # idempotent
    # HF's own assisted generation still runs when speculation is not asked for
    assisted = models["target"].generate(
        PROMPT, max_new_tokens=20, do_sample=False, assistant_model=models["noisy_copy"]
    )
    assert torch.equal(assisted, expected)


def test_calibration_is_cached(models, tmp_path, monkeypatch):
    kwargs = dict(
        max_new_tokens=10,
        do_sample=False,
        speculation="adaptive",
        assistant_model=models["noisy_copy"],
        max_speculative_tokens=3,
    )
    out = models["target"].generate(PROMPT, **kwargs)  # no speculation_costs: calibrate (private_cache)
    assert torch.equal(out, _plain(models, max_new_tokens=10))
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1
    table = json.loads(files[0].read_text())
    assert len(table["verify_ms"]) == 4 and table["draft_ms"] > 0  # n = 1..k_max+1

    def no_measure(*args, **kwargs):
        raise AssertionError("the cached cost table must be reused")

    monkeypatch.setattr(cost_cache, "measure", no_measure)
    again = models["target"].generate(PROMPT, **kwargs)
    assert torch.equal(again, out)
    with pytest.raises(AssertionError, match="reused"):  # another k_max is another table: it would measure
        models["target"].generate(PROMPT, **{**kwargs, "max_speculative_tokens": 2})
