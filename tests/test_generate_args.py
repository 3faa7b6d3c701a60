"""generate arguments beyond the speculation settings, through the wrapped ``generate``: stop strings (with a
tokenizer built in-test, no files, no downloads) and reproducibility across calls (tiny random Llamas)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from conftest import single_thread
from tokenizers import Tokenizer, models, pre_tokenizers

import hf_adaspec
from hf_adaspec import CostTable, SpeculationState

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
PROMPT = torch.tensor([[3, 4, 5, 3, 4, 5]])  # [1, 6]
NEWLINE = 21  # the 11th greedy token of the tiny target after PROMPT, and its first 21
STOPPED_LENGTH = PROMPT.shape[1] + 11
MODES = [
    pytest.param({"speculation": "adaptive"}, None, id="adaptive-lookup"),
    # without the slowdown bound: it drafts from the first step whatever the model's state learnt before
    pytest.param({"speculation": "adaptive", "max_slowdown": math.inf}, 0, id="adaptive-draft-same-weights"),
    pytest.param({"speculation": "adaptive"}, 1, id="adaptive-draft-other-seed"),
    pytest.param({"speculation": "fixed", "num_speculative_tokens": 2}, 0, id="fixed2-draft-same-weights"),
    pytest.param({"speculation": "fixed", "num_speculative_tokens": 2}, 1, id="fixed2-draft-other-seed"),
]


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer over the tiny Llama's 64 ids: id i is "w{i}", but 0 is "[UNK]" (the pad), 21 is
    a newline and 63 is "abcdef" (StopStringCriteria tokenizes that prefix to clean the vocabulary)."""
    vocab = {f"w{i}": i for i in range(1, 63) if i != NEWLINE} | {"[UNK]": 0, "\n": NEWLINE, "abcdef": 63}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[UNK]")


@pytest.fixture(scope="module")
def target(tiny_factory):
    with single_thread():  # the model's own thread chooser follows torch's count at enable; one_thread comes later
        return hf_adaspec.enable(tiny_factory(0))


def _draft(tiny_factory, seed):
    return {} if seed is None else {"assistant_model": tiny_factory(seed)}


def _plain_stopped(model, tokenizer):
    """Plain greedy generate with the stop string; checks it stopped on the newline, early."""
    plain = model.generate(PROMPT, max_new_tokens=30, do_sample=False, stop_strings=["\n"], tokenizer=tokenizer)
    assert plain.shape == (1, STOPPED_LENGTH) and int(plain[0, -1]) == NEWLINE
    assert tokenizer.decode(plain[0, PROMPT.shape[1] :]).endswith("\n")
    return plain


# the fast suite keeps fixed2-draft-same-weights (the newline cut inside an accepted block); the rest are slow
@pytest.mark.parametrize(
    ("mode", "draft_seed"),
    [
        pytest.param(*m.values, id=m.id, marks=() if m.id == "fixed2-draft-same-weights" else pytest.mark.slow)
        for m in MODES
    ],
)
def test_stop_strings_stop_like_plain_generate(target, tiny_factory, tokenizer, mode, draft_seed):
    """The draft with the target's weights accepts whole blocks: the newline lands inside one, which is cut."""
    plain = _plain_stopped(target, tokenizer)
    out = target.generate(
        PROMPT,
        max_new_tokens=30,
        do_sample=False,
        stop_strings=["\n"],
        tokenizer=tokenizer,
        speculation_costs=COSTS,
        return_dict_in_generate=True,
        **_draft(tiny_factory, draft_seed),
        **mode,
    )
    assert torch.equal(out.sequences, plain)
    last = out.speculation.steps[-1]
    if draft_seed == 0:
        assert last.accepted == last.k and last.emitted < last.k + 1


# the fast suite keeps adaptive-lookup; the drafting cases are slow
@pytest.mark.parametrize(
    ("mode", "draft_seed"),
    [
        pytest.param(*m.values, id=m.id, marks=() if m is MODES[0] else pytest.mark.slow)
        for m in (MODES[0], MODES[1], MODES[3])
    ],
)
def test_stop_strings_from_a_generation_config(target, tiny_factory, tokenizer, mode, draft_seed):
    plain = _plain_stopped(target, tokenizer)
    config = transformers.GenerationConfig(max_new_tokens=30, do_sample=False, stop_strings="\n", pad_token_id=0)
    out = target.generate(
        PROMPT,
        generation_config=config,
        tokenizer=tokenizer,
        speculation_costs=COSTS,
        **_draft(tiny_factory, draft_seed),
        **mode,
    )
    assert torch.equal(out, plain) and config.stop_strings == "\n"  # the caller's config is left as it was


def test_stop_strings_from_the_models_generation_config(tiny_factory, tokenizer):
    model = hf_adaspec.enable(tiny_factory(0))
    model.generation_config.stop_strings = ["\n"]
    plain = model.generate(PROMPT, max_new_tokens=30, do_sample=False, tokenizer=tokenizer)
    assert plain.shape == (1, STOPPED_LENGTH)
    for mode, draft_seed in (MODES[0].values, MODES[3].values):
        out = model.generate(
            PROMPT,
            max_new_tokens=30,
            do_sample=False,
            tokenizer=tokenizer,
            speculation_costs=COSTS,
            **_draft(tiny_factory, draft_seed),
            **mode,
        )
        assert torch.equal(out, plain)
    out = model.generate(
        PROMPT,
        max_new_tokens=30,
        do_sample=False,
        stop_strings=None,
        tokenizer=tokenizer,
        speculation="adaptive",
        speculation_costs=COSTS,
    )
    assert out.shape == (1, PROMPT.shape[1] + 30)  # stop_strings=None overrides the model's, as in plain generate


def test_stop_strings_with_a_stopping_criterion_of_the_caller(target, tokenizer):
    """A caller's StopStringCriteria wins over generate's, as in plain generate (here: stop on w30 instead)."""
    mine = transformers.StoppingCriteriaList([transformers.StopStringCriteria(tokenizer, "w30")])
    kwargs = {
        "max_new_tokens": 30,
        "do_sample": False,
        "stop_strings": ["\n"],
        "tokenizer": tokenizer,
        "stopping_criteria": mine,
    }
    plain = target.generate(PROMPT, **kwargs)
    assert plain.shape == (1, PROMPT.shape[1] + 1)
    assert torch.equal(target.generate(PROMPT, speculation="adaptive", speculation_costs=COSTS, **kwargs), plain)


def test_stop_strings_without_a_tokenizer_name_it(target):
    for mode in ({}, {"speculation": "adaptive", "speculation_costs": COSTS}):
        with pytest.raises(ValueError, match="`tokenizer` argument"):
            target.generate(PROMPT, max_new_tokens=5, stop_strings=["\n"], **mode)


def _sample_three(target, draft, state_for):
    """Three seeded sampling calls; ``state_for()``: the speculation_state keywords of each call; rest=False: the
    decisions do not depend on the engine's timing."""
    outs = []
    for _ in range(3):
        torch.manual_seed(0)
        outs.append(
            target.generate(
                PROMPT,
                max_new_tokens=30,
                do_sample=True,
                speculation="adaptive",
                assistant_model=draft,
                speculation_costs=COSTS,
                return_dict_in_generate=True,
                rest=False,
                **state_for(),
            )
        )
    return outs


def test_seeded_sampling_with_a_fresh_state_is_reproducible(tiny_factory):
    """A fresh SpeculationState per call (and rest=False) makes seeded sampled outputs, and every decision, repeat
    exactly."""
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(1)
    outs = _sample_three(target, draft, lambda: {"speculation_state": SpeculationState()})
    for out in outs[1:]:
        assert torch.equal(out.sequences, outs[0].sequences)
        assert [(s.drafter, s.k, s.accepted) for s in out.speculation.steps] == [
            (s.drafter, s.k, s.accepted) for s in outs[0].speculation.steps
        ]


@pytest.mark.slow  # the fast suite keeps test_seeded_sampling_with_a_fresh_state_is_reproducible for reproducibility
def test_the_models_own_state_changes_seeded_outputs_across_calls(tiny_factory):
    """With the model's shared state the same seeded call drafts differently as it learns, and the sampled
    tokens differ with the drafting (the same distribution, other draws): the reason to pass a fresh
    SpeculationState for reproducible runs. The first call starts from a fresh state, so it matches one."""
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(1)
    (fresh, *_) = _sample_three(target, draft, lambda: {"speculation_state": SpeculationState()})
    outs = _sample_three(target, draft, dict)
    assert torch.equal(outs[0].sequences, fresh.sequences)
    assert not torch.equal(outs[1].sequences, outs[0].sequences)
    plans = [[(s.drafter, s.k) for s in out.speculation.steps] for out in outs]
    assert plans[1] != plans[0]
