"""One owner for what is kept per model: the weights' identity that keys learned state
(``hf_compat.weights_identity``), a model's arenas (``backend.arenas.ModelArenas``), the ``ModelState`` that
``enable`` makes (one request per model at a time), and the attention a request swaps in and out
(``hf_compat.speculative_attention``)."""

from __future__ import annotations

import copy
import gc
import math
import threading
import time
import weakref

import pytest
import torch
import transformers

import hf_adaspec
from hf_adaspec import CostTable, SpeculationState
from hf_adaspec.backend import hf_compat
from hf_adaspec.backend.arenas import arenas_of
from hf_adaspec.backend.hf_compat import model_calls, model_facts
from hf_adaspec.engine.owner import ModelState
from hf_adaspec.policy.modes import assistant_identity

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)
SPECULATIVE = dict(
    speculation="adaptive", speculation_costs=COSTS, max_new_tokens=16, do_sample=False, max_slowdown=math.inf
)  # the draft drafts from the first step


def test_weights_identity_follows_the_weights_not_the_object(tiny_factory):
    model = tiny_factory(0)
    key = hf_compat.weights_identity(model)
    assert len(key) == 16 and hf_compat.weights_identity(copy.deepcopy(model)) == key
    assert hf_compat.weights_identity(tiny_factory(0)) == key  # the same seed: the same weights
    assert hf_compat.weights_identity(tiny_factory(1)) != key  # one config, another seed
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        perturbed.model.layers[1].mlp.down_proj.weight.add_(1e-3 * torch.randn(32, 64))
    assert hf_compat.weights_identity(perturbed) != key
    assert hf_compat.weights_identity(copy.deepcopy(model).to(torch.bfloat16)) != key  # another dtype


@pytest.mark.slow  # two loads from disk; the fast suite keeps test_weights_identity_follows_the_weights_not_the_object
def test_weights_identity_is_stable_across_a_reload_of_the_same_state_dict(tiny_factory, tmp_path):
    model = tiny_factory(0)
    fresh = transformers.LlamaForCausalLM(model.config).eval()  # other random weights, then the same ones
    fresh.load_state_dict(model.state_dict())
    assert hf_compat.weights_identity(fresh) == hf_compat.weights_identity(model)
    model.save_pretrained(tmp_path)
    loads = [transformers.AutoModelForCausalLM.from_pretrained(tmp_path) for _ in range(2)]
    assert hf_compat.weights_identity(loads[0]) == hf_compat.weights_identity(loads[1])


def test_weights_identity_reads_a_wrapper_subclass_through_its_inner_tensors(tiny_factory):
    """A tensor subclass that wraps others (as torchao's quantized weights do) is fingerprinted by what it wraps."""
    from torch.testing._internal.two_tensor import TwoTensor

    keys = []
    for value in (0.0, 1.0):
        model = tiny_factory(0)
        weight = model.lm_head.weight.detach()
        model.lm_head.weight = torch.nn.Parameter(
            TwoTensor(weight, torch.full_like(weight, value)), requires_grad=False
        )
        keys.append(hf_compat.weights_identity(model))
    assert keys[0] != keys[1]


def test_weights_identity_is_computed_once_per_module(tiny_factory, monkeypatch):
    model, calls = tiny_factory(0), []
    identity = model_facts.model_identity
    monkeypatch.setattr(model_facts, "model_identity", lambda m: calls.append(m) or identity(m))
    first = hf_compat.weights_identity(model)
    assert hf_compat.weights_identity(model) == first and len(calls) == 1


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_learned_state_is_keyed_by_the_drafts_weights(tiny_factory):
    """Draft objects with one set of weights share a calibration; other weights get their own; the key is the
    weights', never the object's id (which a later model can reuse)."""
    target = hf_adaspec.enable(tiny_factory(0))
    state, draft = SpeculationState(), tiny_factory(1)
    for assistant in (draft, copy.deepcopy(draft)):
        target.generate(PROMPT, assistant_model=assistant, speculation_state=state, **SPECULATIVE)
    assert set(state.calibrators._calibrators) == {f"draft_model:{hf_compat.weights_identity(draft)}"}
    other = tiny_factory(2)
    target.generate(PROMPT, assistant_model=other, speculation_state=state, **SPECULATIVE)
    assert len(state.calibrators._calibrators) == 2
    assert assistant_identity(other) == hf_compat.weights_identity(other) and str(id(other)) not in str(
        list(state.calibrators._calibrators)
    )
    assert assistant_identity(None) == "none"


def test_a_models_arenas_have_one_owner_that_lives_as_long_as_the_model(tiny_factory):
    model = tiny_factory(0)
    owner = arenas_of(model)
    assert arenas_of(model) is owner and owner.model is model
    arena = owner.arena("probe", 3, 256)
    assert arena.batch == 4 and owner.arena("probe", 4, 256) is arena and owner.widest_capacity("probe", 3) == 256
    owner.compile(frozenset({1}))  # recordings made before are dropped
    assert owner.compiled == {1} and owner.widest_capacity("probe", 3) == 0
    assert owner.arena("probe", 1, 256).compiled == {1}
    kept = weakref.ref(owner)
    del model, owner, arena
    gc.collect()
    assert kept() is None


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_plain_generate_after_enable_runs_transformers_attention(tiny_factory, monkeypatch):
    """enable leaves the model's attention alone: plain generate runs transformers' own and gives what it gave
    before; a speculative request runs the packed attention (target and draft) and puts theirs back."""
    model, draft = tiny_factory(0), tiny_factory(1)
    before = model.generate(PROMPT, max_new_tokens=16, do_sample=False)
    implementation = model.config._attn_implementation
    hf_adaspec.enable(model)
    packed = []
    gqa = model_calls.packed_gqa
    monkeypatch.setattr(model_calls, "packed_gqa", lambda *args: packed.append(1) or gqa(*args))
    assert model.config._attn_implementation == implementation == "sdpa"
    assert torch.equal(model.generate(PROMPT, max_new_tokens=16, do_sample=False), before) and not packed
    during = []
    spec = model.generate(
        PROMPT,
        assistant_model=draft,
        speculation_state=SpeculationState(),
        **SPECULATIVE,
        speculation_callback=lambda record, tokens: during.append(
            (model.config._attn_implementation, draft.config._attn_implementation)
        ),
    )
    assert torch.equal(spec, before) and packed and set(during) == {(hf_compat.PACKED_SDPA,) * 2}
    assert (model.config._attn_implementation, draft.config._attn_implementation) == (implementation,) * 2
    packed.clear()
    assert torch.equal(model.generate(PROMPT, max_new_tokens=16, do_sample=False), before) and not packed
    spec = model.generate(PROMPT, assistant_model=draft, speculation_state=SpeculationState(), **SPECULATIVE)
    assert torch.equal(spec, before) and packed and model.config._attn_implementation == implementation


def test_an_attention_swap_notes_anew_when_the_model_changed_under_it(tiny_factory):
    model = tiny_factory(0)
    swap = hf_compat.AttentionSwap(model)
    with hf_compat.speculative_attention(swap):
        assert model.config._attn_implementation == hf_compat.PACKED_SDPA
    model.set_attn_implementation("eager")
    with hf_compat.speculative_attention(swap):
        assert model.config._attn_implementation == "eager"  # packing replaces sdpa only
    model.set_attn_implementation("sdpa")
    with pytest.raises(KeyError), hf_compat.speculative_attention(swap):
        raise KeyError("the block raised")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.usefixtures("one_thread", "private_cache")
def test_a_generate_inside_a_request_on_the_same_model_names_the_fix(models):
    target, draft = models["target"], models["noisy_copy"]

    def again(record, tokens):
        target.generate(PROMPT, assistant_model=draft, speculation_state=SpeculationState(), **SPECULATIVE)

    with pytest.raises(RuntimeError, match="one request per model at a time"):
        target.generate(
            PROMPT,
            assistant_model=draft,
            speculation_state=SpeculationState(),
            speculation_callback=again,
            **SPECULATIVE,
        )
    assert target.config._attn_implementation == draft.config._attn_implementation == "sdpa"
    out = target.generate(PROMPT, assistant_model=draft, speculation_state=SpeculationState(), **SPECULATIVE)
    assert torch.equal(out, target.generate(PROMPT, max_new_tokens=16, do_sample=False))  # held no more


# the fast suite keeps test_a_generate_inside_a_request_on_the_same_model_names_the_fix (one request per model)
@pytest.mark.slow  # three requests and a 0.3 s wait
@pytest.mark.usefixtures("one_thread", "private_cache")
def test_a_second_threads_request_on_the_model_waits_for_the_first(models):
    """Two speculative requests on one model from two threads run one after the other, each as it runs alone."""
    target, draft = models["target"], models["noisy_copy"]
    alone = target.generate(PROMPT, assistant_model=draft, speculation_state=SpeculationState(), **SPECULATIVE)
    steps, out = [], {}

    def run(name: str, on_step) -> None:
        out[name] = target.generate(
            PROMPT,
            assistant_model=draft,
            speculation_state=SpeculationState(),
            speculation_callback=on_step,
            **SPECULATIVE,
        )

    second = threading.Thread(target=run, args=("second", lambda record, tokens: steps.append("second")))

    def first_step(record, tokens) -> None:
        steps.append("first")
        if record is None:  # the prefill's token: the second request starts, and has time to reach the model
            second.start()
            time.sleep(0.3)

    run("first", first_step)
    second.join(timeout=120)
    assert not second.is_alive() and steps == sorted(steps)  # every step of the first before the second's
    assert "second" in steps and torch.equal(out["first"], alone) and torch.equal(out["second"], alone)


def test_a_request_learns_into_the_given_state_or_the_models_own(tiny_factory):
    model = hf_adaspec.enable(tiny_factory(0))
    owner = ModelState(model)
    assert owner.arenas is arenas_of(model)
    given = SpeculationState()
    with owner.request(None, given) as learned:
        assert learned is given
    with owner.request(None) as learned:
        assert learned is owner.learned
