"""The lean decoder layer (``models.lean_layer``, ``hf_compat.lean_attention``): each replaced module computes what
transformers' module computes, for every family it is registered for; a model of another family is left as it is;
a q4 model's greedy output is unchanged by it."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import transformers
from conftest import slow_except

import hf_adaspec
from hf_adaspec.backend import hf_compat
from hf_adaspec.kernels.fused import GatedMLP
from hf_adaspec.kernels.layer_ops import RMSNorm, RopeSplit, rms_norm_reference, rope_split, rotate_half_reference
from hf_adaspec.kernels.q4_layer import Q4Linear
from hf_adaspec.models import format_load, lean_layer

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
BASE = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {},
    "smollm3": {"no_rope_layers": [1, 1]},
    "gemma": {},
    "gemma3_text": {},
}


def _tiny(model_type: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    config = transformers.AutoConfig.for_model(model_type, **BASE, **FAMILIES[model_type])
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b as close as two float32 sums of squares in another order allow: bfloat16 within one unit in the last
    place (the normalized value is rounded to it, so the scale's last bits rarely show); float32 within a relative
    1e-5 (a sum of H squares carries a relative error of about √H float32 epsilons)."""
    if a.dtype == torch.bfloat16:
        return _ulps(a, b) <= 1
    return torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between a and b in units of the last place of their dtype (bfloat16 or float32)."""
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    return int((a.view(bits).long() - b.view(bits).long()).abs().max())


def _swiglu_close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The kernel's SwiGLU against torch's: float32 within a relative 1e-6 (its sigmoid a few units in the last
    place from torch's), bfloat16 within one unit in the last place (a float32 difference can cross a rounding)."""
    if got.dtype == torch.bfloat16:
        return _ulps(got, want) <= 1
    return torch.allclose(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


def test_every_registered_class_is_one_transformers_ships():
    for name in lean_layer.RMS_NORMS | lean_layer.GATED_MLPS:
        module, _, cls = name.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), cls), type), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [17, 64, 1536])
def test_rms_norm_is_the_llama_formula_to_the_last_bit(dtype, width, kernel_dir):
    """Within a few units in the last place (``_close``); each row as computed alone."""
    weight = torch.nn.Parameter((torch.randn(width) * 2).to(dtype))
    norm = RMSNorm(weight, 1e-6, kernel_dir)
    x = (torch.randn(3, 40, width) * 5).to(dtype)
    y = norm(x)
    assert y.dtype == dtype and y.shape == x.shape
    assert _close(y, rms_norm_reference(x, weight, 1e-6))
    assert torch.equal(norm(x[1:2, 7:8]), y[1:2, 7:8])
    assert torch.equal(norm(x.transpose(0, 1)), y.transpose(0, 1))  # strided input


def test_rms_norm_of_other_dtypes_takes_the_formula(kernel_dir):
    weight = torch.nn.Parameter(torch.randn(32))
    x = torch.randn(2, 32, dtype=torch.bfloat16)  # float32 weight, bfloat16 activations: promoted to float32
    assert torch.equal(RMSNorm(weight, 1e-5, kernel_dir)(x), rms_norm_reference(x, weight, 1e-5))


def test_a_copied_rms_norm_computes_as_its_original(kernel_dir):
    norm = RMSNorm(torch.nn.Parameter(torch.randn(48, dtype=torch.bfloat16)), 1e-6, kernel_dir)
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    assert torch.equal(copy.deepcopy(norm)(x), norm(x))


def _rope_reference(qkv, cos, sin, heads, kv_heads):
    b, n, width = qkv.shape
    q, k, v = qkv.view(b, n, -1, width // (heads + 2 * kv_heads)).transpose(1, 2).split([heads, kv_heads, kv_heads], 1)
    return rotate_half_reference(q, cos, sin), rotate_half_reference(k, cos, sin), v


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "b,n,heads,kv_heads,d,cos_rows", [(1, 1, 12, 2, 128, 1), (2, 3, 3, 1, 6, 2), (2, 5, 4, 4, 34, 1)]
)
def test_rope_split_rotates_as_transformers_to_the_bit(dtype, b, n, heads, kv_heads, d, cos_rows, kernel_dir):
    """Head widths whose halves fill no vector, or a part of one; cos and sin per batch row or shared."""
    gen = torch.Generator().manual_seed(d)
    qkv = (torch.randn(b, n, (heads + 2 * kv_heads) * d, generator=gen) * 4).to(dtype)
    cos, sin = (torch.randn(cos_rows, n, d, generator=gen).to(dtype) for _ in range(2))
    want = _rope_reference(qkv, cos, sin, heads, kv_heads)
    split = RopeSplit(heads, kv_heads, kernel_dir)
    for got in (
        rope_split(qkv, cos, sin, heads, kv_heads, kernel_dir),
        split(qkv, cos, sin),
        copy.deepcopy(split)(qkv, cos, sin),
    ):
        for g, w in zip(got, want, strict=True):
            assert g.is_contiguous() and g.dtype == dtype and torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_split_into_a_cache_writes_the_split_s_keys_and_values_there(dtype, kernel_dir):
    """Columns 4 … 6 of a cache's buffers take the split's keys and values, the rest stay; buffers of another dtype
    take them as a cache's update does (cast); columns past the buffers are refused."""
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(2, 3, 8 * 8, generator=gen).to(dtype)
    cos, sin = (torch.randn(1, 3, 8, generator=gen).to(dtype) for _ in range(2))
    split = RopeSplit(4, 2, kernel_dir)
    q, k, v = split(qkv, cos, sin)
    keys, values = torch.full((2, 2, 10, 8), 7.0, dtype=dtype), torch.full((2, 2, 10, 8), 7.0, dtype=dtype)
    assert torch.equal(split.into_cache(qkv, cos, sin, keys, values, 4), q)
    assert torch.equal(keys[:, :, 4:7], k) and torch.equal(values[:, :, 4:7], v)
    assert keys[:, :, 7:].eq(7).all() and keys[:, :, :4].eq(7).all() and values[:, :, 7:].eq(7).all()
    halves = torch.zeros(2, 2, 3, 8, dtype=torch.float16), torch.zeros(2, 2, 3, 8, dtype=torch.float16)
    assert torch.equal(split.into_cache(qkv, cos, sin, *halves, 0), q)
    assert torch.equal(halves[0], k.half()) and torch.equal(halves[1], v.half())
    with pytest.raises(ValueError, match="cannot take"):
        split.into_cache(qkv, cos, sin, keys, values, 8)


def test_rope_split_of_other_dtypes_takes_torch_s_operations(kernel_dir):
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(1, 2, 4 * 8, generator=gen, dtype=torch.float16)
    cos, sin = torch.randn(1, 2, 8, generator=gen), torch.randn(1, 2, 8, generator=gen)  # float32: another dtype
    for got, want in zip(rope_split(qkv, cos, sin, 2, 1, kernel_dir), _rope_reference(qkv, cos, sin, 2, 1)):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="even width"):
        rope_split(torch.randn(1, 1, 4 * 7), cos, sin, 2, 1, kernel_dir)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_family_s_modules_equal_their_lean_replacements(family, dtype, kernel_dir):
    model = _tiny(family, dtype)
    x = (torch.randn(2, 5, BASE["hidden_size"]) * 3).to(dtype)
    norms = mlps = 0
    with torch.inference_mode():
        for module in list(model.modules()):
            kind = lean_layer.qualified_name(module)
            if kind in lean_layer.RMS_NORMS:
                lean = RMSNorm(module.weight, module.variance_epsilon, kernel_dir)
                h = (torch.randn(2, 5, module.weight.shape[0]) * 3).to(dtype)  # Qwen3's q/k norms: one head wide
                assert _close(lean(h), module(h))
                norms += 1
            if kind in lean_layer.GATED_MLPS:
                for name in ("gate_proj", "up_proj", "down_proj"):
                    setattr(module, name, Q4Linear.dense(getattr(module, name), kernel_dir))
                lean = GatedMLP(module.gate_proj, module.up_proj, module.down_proj, module.act_fn, kernel_dir)
                if lean.silu:  # the kernel's SwiGLU: torch's silu(gate) · up but for its sigmoid's last bits
                    gated = module.act_fn(module.gate_proj(x)) * module.up_proj(x)
                    assert _swiglu_close(lean.gate_up.swiglu(x), gated)
                    assert torch.equal(lean(x), module.down_proj(lean.gate_up.swiglu(x)))
                else:
                    assert torch.equal(lean(x), module(x))  # the same kernel calls and activation: the same bits
                mlps += 1
    assert mlps == BASE["num_hidden_layers"]
    layers = BASE["num_hidden_layers"]  # Gemma's norm is another formula; Qwen3 adds q/k norms per layer
    assert norms == (0 if family.startswith("gemma") else 2 * layers + 1 + (2 * layers if family == "qwen3" else 0))


def test_q4_models_of_known_families_load_lean_and_others_do_not():
    llama = format_load.convert(_tiny("llama"), "q4", False)
    assert sum(isinstance(m, RMSNorm) for m in llama.modules()) == 2 * BASE["num_hidden_layers"] + 1
    assert sum(isinstance(m, GatedMLP) for m in llama.modules()) == BASE["num_hidden_layers"]
    phi3 = format_load.convert(_tiny_phi3(), "q4", False)
    assert not any(isinstance(m, (RMSNorm, GatedMLP)) for m in phi3.modules())


def _tiny_phi3() -> torch.nn.Module:
    config = transformers.AutoConfig.for_model("phi3", **BASE)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


# the fast suite keeps test_each_family_s_modules_equal_their_lean_replacements (the same bits per module) and
# test_an_enabled_q4_model_speculates_past_its_window_as_it_decodes_plainly (greedy through lean modules)
@pytest.mark.slow  # two q4 conversions, three requests
def test_a_lean_q4_model_decodes_as_the_same_model_without_it(monkeypatch):
    """The same q4 blocks with and without the lean modules: the same greedy tokens, speculative or plain."""
    lean = hf_adaspec.enable(format_load.convert(_tiny("qwen2", seed=3), "q4", False))
    monkeypatch.setattr(lean_layer, "lean", lambda model, directory: 0)
    plain_modules = hf_adaspec.enable(format_load.convert(_tiny("qwen2", seed=3), "q4", False))
    assert not any(isinstance(m, RMSNorm) for m in plain_modules.modules())
    prompt = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(1))
    expected = plain_modules.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(lean.generate(prompt, max_new_tokens=24, do_sample=False), expected)
    spec = lean.generate(
        prompt,
        max_new_tokens=24,
        do_sample=False,
        assistant_model=plain_modules,
        speculation="fixed",
        num_speculative_tokens=3,
    )
    assert torch.equal(spec, expected)


@pytest.mark.parametrize(  # the fast suite keeps llama and a windowed qwen2 in bfloat16; make test runs all
    "family,extra",
    [
        ("llama", {}),
        pytest.param("qwen2", {}, marks=pytest.mark.slow),
        pytest.param("mistral", {}, marks=pytest.mark.slow),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
        pytest.param("mistral", {"sliding_window": 4}, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("dtype", slow_except([torch.bfloat16, torch.float32], fast={torch.bfloat16}))
@pytest.mark.parametrize(  # the fast suite keeps the packed attention, which q4 models run; make test runs all
    "implementation",
    [
        pytest.param("sdpa", marks=pytest.mark.slow),
        pytest.param("eager", marks=pytest.mark.slow),
        hf_compat.PACKED_SDPA,
    ],
)
def test_lean_attention_gives_transformers_logits_to_the_bit(family, extra, dtype, implementation):
    """A prompt, then one token and then three on its cache (a step, a verification), windows included: the
    same logits with and without ``LeanAttention``."""
    config = transformers.AutoConfig.for_model(family, **BASE, **extra)
    torch.manual_seed(5)
    model = format_load.convert(transformers.AutoModelForCausalLM.from_config(config).to(dtype).eval(), "q4", False)
    if implementation == hf_compat.PACKED_SDPA:
        hf_compat.use_packed_attention(model)
    else:
        model.set_attn_implementation(implementation)
    blocks = [torch.randint(1, 64, (2, n), generator=torch.Generator().manual_seed(n)) for n in (7, 1, 3)]

    def logits() -> list[torch.Tensor]:
        cache = transformers.DynamicCache(config=model.config)
        with torch.inference_mode():
            return [model(block, past_key_values=cache).logits for block in blocks]

    before = logits()
    assert hf_compat.use_lean_attention(model) == BASE["num_hidden_layers"]
    assert hf_compat.use_lean_attention(model) == 0  # idempotent
    for got, want in zip(logits(), before):
        assert torch.equal(got, want)


def test_lean_attention_of_a_model_in_eval_mode_does_not_drop_out():
    """A module is made in training mode: ``LeanAttention`` takes the mode of the module it replaces, so an eval
    model whose config asks for attention dropout gives the same logits with it as without it."""
    config = transformers.AutoConfig.for_model("llama", **BASE, attention_dropout=0.5)
    torch.manual_seed(5)
    model = format_load.convert(transformers.AutoModelForCausalLM.from_config(config).eval(), "q4", False)
    hf_compat.use_packed_attention(model)
    block = torch.randint(1, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(block).logits
        hf_compat.use_lean_attention(model)
        lean = [m for m in model.modules() if isinstance(m, hf_compat.lean_attention.LeanAttention)]
        assert len(lean) == BASE["num_hidden_layers"] and not any(m.training for m in lean)
        assert torch.equal(model(block).logits, want)


def test_lean_attention_follows_a_change_of_implementation_and_a_copy():
    """The attention function looked up on the first call is looked up again when the model's implementation
    changes; a copy of the model reads its own config."""
    torch.manual_seed(5)
    model = format_load.convert(_tiny("qwen2"), "q4", False)
    model.set_attn_implementation("sdpa")
    hf_compat.use_lean_attention(model)
    block = torch.randint(1, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    calls = []

    def counted(module, *args, **kwargs):
        calls.append(module)
        return transformers.integrations.sdpa_attention.sdpa_attention_forward(module, *args, **kwargs)

    transformers.AttentionInterface.register("counted_sdpa", counted)
    with torch.inference_mode():
        want = model(block).logits
        model.set_attn_implementation("counted_sdpa")
        assert torch.equal(model(block).logits, want) and len(calls) == BASE["num_hidden_layers"]
        copied = copy.deepcopy(model)
        copied.set_attn_implementation("sdpa")
        assert torch.equal(copied(block).logits, want) and len(calls) == BASE["num_hidden_layers"]
        assert torch.equal(model(block).logits, want) and len(calls) == 2 * BASE["num_hidden_layers"]


def test_lean_attention_leaves_other_families_and_dense_models_alone():
    assert hf_compat.use_lean_attention(format_load.convert(_tiny("qwen3"), "q4", False)) == 0  # q/k norms: unlisted
    assert hf_compat.use_lean_attention(_tiny("llama")) == 0  # dense projections: nothing fused


def test_every_registered_attention_is_one_transformers_ships_with_its_eager_function():
    for name in hf_compat.lean_attention.ATTENTIONS:
        module, _, cls = name.rpartition(".")
        imported = importlib.import_module(module)
        assert isinstance(getattr(imported, cls), type) and callable(imported.eager_attention_forward), name


def test_an_enabled_q4_model_speculates_past_its_window_as_it_decodes_plainly():
    """Sliding-window Qwen2 in float32 with the lean layer throughout: speculative greedy equals plain greedy."""
    config = transformers.AutoConfig.for_model(
        "qwen2", **BASE, use_sliding_window=True, sliding_window=6, max_window_layers=1
    )
    torch.manual_seed(9)
    target = hf_adaspec.enable(
        format_load.convert(transformers.AutoModelForCausalLM.from_config(config).eval(), "q4", False)
    )
    target.generation_config.eos_token_id = None
    prompt = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(2))
    plain = target.generate(prompt, max_new_tokens=20, do_sample=False)
    lean = []  # the lean modules during each step of the speculative request (swapped in for it, out after)
    spec = target.generate(
        prompt,
        max_new_tokens=20,
        do_sample=False,
        assistant_model=target,
        speculation="fixed",
        num_speculative_tokens=3,
        speculation_callback=lambda record, tokens: lean.append(
            sum(isinstance(m, hf_compat.lean_attention.LeanAttention) for m in target.modules())
        ),
    )
    assert torch.equal(spec, plain)
    assert set(lean) == {2}
    assert not any(isinstance(m, hf_compat.lean_attention.LeanAttention) for m in target.modules())
