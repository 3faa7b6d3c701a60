"""``hf_compat.flat_forward``: a q4 model's forward as one flat loop (or its decoder stack as one C call) gives
transformers' logits and features within the attention's rounding, each row's bits its own (a verification's rows
are the steps'), the stack the loop's bits; it runs only where that holds, and sees a changed model."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import transformers
from conftest import slow_except
from test_lean_layer import BASE  # the tiny models' shape

import hf_adaspec
from hf_adaspec.backend import hf_compat
from hf_adaspec.backend.hf_compat import flat_forward, flat_generate, model_calls
from hf_adaspec.backend.hf_compat.cache_layers import GrowingLayer
from hf_adaspec.kernels.decoder import DecoderStack
from hf_adaspec.models import format_load

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")


def _q4(
    family: str, dtype: torch.dtype = torch.float32, seed: int = 5, quantize_head: bool = False, **extra
) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(family, **BASE, **extra)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model = hf_adaspec.enable(format_load.convert(model, "q4", quantize_head))
    hf_compat.use_packed_attention(model)
    return model


@pytest.fixture
def flat_runs(monkeypatch):
    """The blocks the flat forward ran (its n), through ``model_calls.forward``."""
    ran = []
    real = flat_forward.flat_forward

    def counted(model, input_ids, *args):
        out = real(model, input_ids, *args)
        if out is not None:
            ran.append(input_ids.shape[1])
        return out

    monkeypatch.setattr(model_calls, "flat_forward", counted)
    return ran


def _run(model: torch.nn.Module, blocks: list[torch.Tensor], layers: tuple[int, ...] = ()) -> list:
    cache = hf_compat.new_cache(model)
    with torch.inference_mode():
        return [hf_compat.forward(model, block, cache, block.shape[1], feature_layers=layers) for block in blocks]


@pytest.fixture
def stack_runs(monkeypatch):
    """The blocks the decoder stack ran (its n)."""
    ran = []
    real = DecoderStack.run

    def counted(self, x, *args):
        ran.append(x.shape[1])
        return real(self, x, *args)

    monkeypatch.setattr(DecoderStack, "run", counted)
    return ran


@pytest.mark.parametrize("family", slow_except(["llama", "qwen2"], fast={"qwen2"}))
@pytest.mark.parametrize("dtype", slow_except([torch.float32, torch.bfloat16], fast={torch.bfloat16}))
def test_flat_forward_gives_transformers_logits_and_features_within_the_attentions_rounding(
    family, dtype, flat_runs, stack_runs, monkeypatch
):
    """A prompt (the model's own forward), then a step, a verification, a step and a longer block, two rows, with
    features out of order (the layer loop) and without (the stack): transformers' logits and features but for the
    attention's last bits; the stack gives the loop's logits to the bit."""
    model, tol = _q4(family, dtype), 1e-5 if dtype == torch.float32 else 2e-2
    blocks = [torch.randint(1, 64, (2, n), generator=torch.Generator().manual_seed(n)) for n in (7, 1, 3, 1, 5)]
    flat = _run(model, blocks, layers=(1, 0))
    stacked = _run(model, blocks)
    assert flat_runs == [1, 3, 1, 5] * 2 and stack_runs == [1, 3, 1, 5]
    monkeypatch.setattr(model_calls, "flat_forward", lambda *args: None)
    for (logits, features), (stack_logits, _), (want_logits, want_features) in zip(
        flat, stacked, _run(model, blocks, layers=(1, 0))
    ):
        assert torch.equal(stack_logits, logits)
        assert torch.allclose(logits.float(), want_logits.float(), atol=tol, rtol=0)
        assert torch.allclose(features.float(), want_features.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("dtype", slow_except([torch.float32, torch.bfloat16], fast={torch.bfloat16}))
def test_a_verifications_rows_are_the_steps_rows_to_the_bit(dtype, stack_runs):
    """Five tokens verified in one block and the same five decoded one at a time, after the same prompt: each
    position's logits the same bits (greedy speculative decoding then equals plain greedy). The head is q4 too (a
    dense head's BLAS product over 5 rows may differ from its product over 1 in the last bits)."""
    model = _q4("qwen2", dtype, quantize_head=True)
    prompt, tokens = torch.randint(1, 64, (1, 9)), torch.randint(1, 64, (1, 5))
    block = _run(model, [prompt, tokens])[1][0]  # [1, 5, V]
    steps = _run(model, [prompt, *tokens.split(1, dim=1)])[1:]
    assert stack_runs == [5, 1, 1, 1, 1, 1]
    assert all(torch.equal(block[:, i], logits[:, 0]) for i, (logits, _) in enumerate(steps))


def test_the_stack_binds_a_replaced_buffer_and_steps_aside_for_torch_s_swiglu_and_a_dense_route(stack_runs):
    """A layer's weights replaced (a copy at another address) are bound again: the same logits; an MLP told to
    take torch's SwiGLU, and a matrix whose dense route takes the block's rows: the loop runs the block."""
    model = _q4("qwen2")
    blocks = [torch.randint(1, 64, (1, n), generator=torch.Generator().manual_seed(n)) for n in (7, 3)]
    want = _run(model, blocks)[1][0]
    o_proj = model.model.layers[1].self_attn.o_proj
    o_proj.blocks = o_proj.blocks.clone()
    assert torch.equal(_run(model, blocks)[1][0], want) and stack_runs == [3, 3]
    model.model.layers[0].mlp.silu = False  # torch's SiLU · up (the loop's)
    assert torch.allclose(_run(model, blocks)[1][0], want, atol=1e-5) and stack_runs == [3, 3]
    model.model.layers[0].mlp.silu = True
    model.model.layers[0].mlp.down_proj.dense_rows = 2
    dense = _run(model, blocks)[1][0]
    assert stack_runs == [3, 3] and torch.equal(dense, _run(model, blocks, layers=(0,))[1][0])  # the loop's


def test_flat_forward_runs_only_what_transformers_would_compute(flat_runs):
    """Windows, another family, dense weights, training mode, a hooked module, a prompt on an empty cache, a block
    wider than ``FLAT_ROWS``, a feature layer past the last or negative: the model's forward."""
    block = torch.randint(1, 64, (1, 2))
    for model in (
        _q4("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1),
        _q4("mistral", sliding_window=4),
        _q4("qwen3"),
    ):
        _run(model, [block, block])
    dense = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **BASE)).eval()
    hf_compat.use_packed_attention(dense)
    _run(dense, [block, block])
    model = _q4("llama")
    model.train()
    _run(model, [block, block])
    model.eval()
    handle = model.model.layers[1].post_attention_layernorm.register_forward_hook(lambda *args: None)
    _run(model, [block, block])
    handle.remove()
    wide = torch.randint(1, 64, (1, flat_forward.FLAT_ROWS + 1))
    _run(model, [block, wide], layers=(BASE["num_hidden_layers"],))
    _run(model, [block, block], layers=(BASE["num_hidden_layers"],))
    _run(model, [block, block], layers=(-1,))
    assert flat_runs == []
    _run(model, [block, block])  # the hook removed: flat again
    assert flat_runs == [2]


def test_flat_forward_follows_the_attention_swap_and_sees_a_replaced_module(flat_runs):
    """Speculation's swap of the attention for ``LeanAttention`` keeps the plan; a replaced norm ends it."""
    model = _q4("qwen2")
    block = torch.randint(1, 64, (1, 3))
    with hf_compat.speculative_attention(hf_compat.AttentionSwap(model)):
        _run(model, [block, block])
    assert flat_runs == [3]
    layer = model.model.layers[0]
    layer.input_layernorm = transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm(BASE["hidden_size"])
    _run(model, [block, block])
    assert flat_runs == [3]


def test_speculative_greedy_through_the_flat_forward_equals_plain_greedy(flat_runs):
    """A q4 Qwen2 in float32: plain greedy through transformers, speculative greedy through the flat forward."""
    target = _q4("qwen2", seed=9)
    target.generation_config.eos_token_id = None
    prompt = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    spec = target.generate(
        prompt,
        max_new_tokens=20,
        do_sample=False,
        assistant_model=target,
        speculation="fixed",
        num_speculative_tokens=3,
    )
    assert torch.equal(spec, plain) and flat_runs


def test_a_growing_layer_opens_columns_for_a_caller_that_writes_them():
    """``open_columns`` grows the buffers, holds the new columns and hands back where to write them; it refuses a
    layer before its first update and a windowed one."""
    layer = GrowingLayer()
    with pytest.raises(ValueError, match="first update"):
        layer.open_columns(1)
    layer.update(torch.zeros(1, 2, 63, 4), torch.zeros(1, 2, 63, 4))
    keys, values, first = layer.open_columns(3)
    assert first == 63 and keys.shape[2] >= 66 and values.shape == keys.shape and keys.is_contiguous()
    keys[:, :, 63:66], values[:, :, 63:66] = 1.0, 2.0
    assert layer.get_seq_length() == 66 and layer.keys[:, :, 63:].eq(1).all() and layer.values[:, :, 63:].eq(2).all()
    windowed = GrowingLayer(("sliding", 4))
    windowed.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))
    with pytest.raises(ValueError, match="window"):
        windowed.open_columns(1)


@pytest.mark.parametrize("family", slow_except(["llama", "qwen2"], fast={"qwen2"}))
@pytest.mark.parametrize("dtype", slow_except([torch.float32, torch.bfloat16], fast={torch.float32}))
def test_plain_generate_through_the_flat_forward_gives_transformers_tokens(family, dtype, monkeypatch, stack_runs):
    """Two rows: the same greedy tokens with the model's flat forward as with transformers'; every step after the
    prompt runs flat, through the decoder stack on the growing layers given to generate's cache; a padded batch,
    beam search (its cache reordered) and a copy run as they should."""
    model = _q4(family, dtype, seed=9)
    hf_compat.use_lean_attention(model)  # as hf_adaspec.load makes it
    model.generation_config.eos_token_id = None
    prompt = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    want = model.generate(prompt, max_new_tokens=12, do_sample=False)
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[0, :3] = 0
    want_padded = model.generate(prompt, attention_mask=padding, max_new_tokens=6, do_sample=False)
    want_beams = model.generate(prompt, num_beams=3, max_new_tokens=6, do_sample=False)
    assert not stack_runs
    ran = []
    real = flat_generate.flat_forward

    def counted(*args):
        out = real(*args)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(flat_generate, "flat_forward", counted)
    assert hf_compat.use_flat_forward(model) and hf_compat.use_flat_forward(model)
    assert "logits_to_keep" in inspect.signature(model.forward).parameters  # what generate inspects
    out = model.generate(prompt, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, want)
    assert ran == [False] + [True] * 11 and stack_runs == [1] * 11  # the prompt runs transformers' forward
    assert all(type(layer) is GrowingLayer for layer in out.past_key_values.layers)
    ran.clear()
    assert torch.equal(model.generate(prompt, attention_mask=padding, max_new_tokens=6, do_sample=False), want_padded)
    assert not any(ran)
    assert torch.equal(model.generate(prompt, num_beams=3, max_new_tokens=6, do_sample=False), want_beams)
    copied = copy.deepcopy(model)
    assert copied.forward.__self__ is copied
    assert torch.equal(copied.generate(prompt, max_new_tokens=12, do_sample=False), want)


def test_the_flat_forward_is_given_only_to_models_of_its_classes():
    model = _q4("qwen3")
    assert not hf_compat.use_flat_forward(model) and "forward" not in model.__dict__
