"""The 4-bit GPU formats (issue 59) as far as a CPU can check them: registration beside the CPU formats (a CPU's
``auto`` and its cache key unchanged), the choice among them from injected timings, a missing kernel named in one
line with NF4 loaded instead, torch's int4 layout against a float reference (the same layer runs torch's CPU int4
op here), and a target's compiled recordings kept only where their replay is faster."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from conftest import save_tiny_llama

import hf_adaspec
from hf_adaspec import CostTable, SpeculationState
from hf_adaspec.backend import static_kv
from hf_adaspec.backend.arenas import arenas_of
from hf_adaspec.backend.graphs import Rerun
from hf_adaspec.bench.bench import divergence_gap
from hf_adaspec.kernels import int4
from hf_adaspec.models import cuda_formats, format_load, formats
from hf_adaspec.models import format_choice as fc
from hf_adaspec.models import format_rules as fr
from hf_adaspec.models.format_choice import FormatMeasure

pytestmark = pytest.mark.usefixtures("one_thread")
GPU_FORMATS = ("int4", "int4-torchao", "gemlite")


def test_the_gpu_formats_are_registered_for_cuda_and_leave_the_cpus_choice_as_it_was():
    for name in GPU_FORMATS:
        assert formats.FORMATS[name].devices == ("cuda",) and name in formats.QUANTIZATIONS
        with pytest.raises(ValueError, match=f"quantization='{name}' runs on cuda only, not cpu"):
            format_load.model_kwargs(name, "bfloat16", "cpu", False)
    assert formats.probed_for("cpu") == ("nf4", "q4", "none")
    assert set(formats.probed_for("cuda:0")) == {"nf4", "none", *GPU_FORMATS}
    key = fc.probe_key("m", "src", "bfloat16", "cpu", False)
    assert key["formats"] == ["nf4", "q4", "none"] and set(key["versions"]) == {"transformers", "bitsandbytes", "torch"}
    cuda = fc.probe_key("m", "src", "bfloat16", "cuda", False)
    assert set(cuda["versions"]) == {"transformers", "bitsandbytes", "torch", "torchao", "gemlite"}


def test_the_cli_names_every_format_from_the_registry_with_the_devices_it_is_made_for():
    from hf_adaspec.cli.pair import QUANTIZATION_HELP

    names = QUANTIZATION_HELP.split(". auto:")[0].split(" | ")
    assert names == ["auto", "nf4", "int8", "q4 (cpu)", "none", *(f"{f} (cuda)" for f in GPU_FORMATS)]


def _m(fmt, ms_1, ms_k, top1=0.95):
    return FormatMeasure(fmt, ms_1, ms_k, top1, 10.0, 1.0)


def test_the_choice_on_a_gpu_weighs_a_verification_per_token_and_keeps_nf4_within_the_margin():
    """Timings shaped as the H200's 7B (NF4 doubles a verification); which format wins is the score's."""
    nf4, dense = _m("nf4", 7.3, 14.3), _m("none", 7.4, 8.6, 1.0)
    fast = (dense, nf4, _m("int4", 4.0, 5.0), _m("gemlite", 3.8, 9.0), FormatMeasure("int4-torchao", error="x"))
    assert fr.pick(fast[1:]) == "int4"  # 4.0 + 5.0/6 beats 3.8 + 9.0/6 (a faster step) and NF4's 7.3 + 14.3/6
    assert fr.pick(fast) == "int4"
    slow = (dense, nf4, _m("int4", 9.0, 10.0))
    assert fr.pick(slow[1:]) == "nf4" and fr.pick(slow) == "none"  # among 4-bit formats NF4 stays where fastest
    near = (nf4, _m("int4", 7.3, 14.3 * (1 - fr.SWITCH_MARGIN) + 0.5))
    assert fr.pick(near) == "nf4"  # within SWITCH_MARGIN of NF4's score
    worse = (nf4, _m("int4", 4.0, 5.0, top1=0.90))
    assert fr.pick(worse) == "nf4"  # below NF4's agreement − tolerance


def test_each_missing_kernel_is_named_in_one_line(monkeypatch):
    assert cuda_formats.missing_int4("cpu") == "torch's int4 kernel: CUDA only, not cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_formats.missing_gemlite("cuda") == "gemlite's Triton kernels: needs a CUDA device, and torch sees none"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert "needs compute capability 8.0 or later; this GPU has 7.5" in cuda_formats.missing_int4("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert cuda_formats.missing_int4("cuda") is None
    found = {"triton": object()}
    monkeypatch.setattr(cuda_formats.importlib.util, "find_spec", lambda name: found.get(name))
    assert cuda_formats.missing_int4_torchao("cuda") == "torchao not installed (pip install torchao)"
    assert cuda_formats.missing_gemlite("cuda") == "torchao, gemlite not installed (pip install torchao gemlite)"
    assert formats.fallback("gemlite", "cuda") == (
        "nf4",
        "hf-adaspec: quantization='gemlite' is not available here (torchao, gemlite not installed (pip "
        "install torchao gemlite)); NF4 used",
    )
    assert formats.fallback("int4", "cuda") == ("int4", None)
    assert formats.fallback("int4", "cpu") == ("int4", None)  # another kind of device: format_of's error, not NF4
    assert formats.fallback("nf4", "cuda") == ("nf4", None)


@pytest.fixture
def tiny_dir(tmp_path, private_cache):
    """A tiny Llama whose linear layers fit torch's int4 kernel (128 wide) and its tokenizer, saved."""
    return save_tiny_llama(tmp_path / "tiny", 128)


@pytest.fixture
def int4_here(monkeypatch):
    """``int4`` made to run on this CPU with its kernel missing: the GPU path's behaviour, on any machine."""
    fmt = dataclasses.replace(formats.FORMATS["int4"], devices=None, missing=lambda device: "the int4 test kernel")
    monkeypatch.setitem(formats.FORMATS, "int4", fmt)


@pytest.mark.slow  # converts to NF4 with bitsandbytes; the fast suite keeps auto's case of a missing kernel
def test_an_explicit_format_whose_kernel_is_missing_loads_nf4_with_one_line(tiny_dir, int4_here):
    lines = []
    lm = hf_adaspec.load(tiny_dir, quantization="int4", dtype="float32", log=lines.append)
    assert lm.weight_format == "nf4" and lm.model.config.quantization_config.quant_method == "bitsandbytes"
    assert lines == ["hf-adaspec: quantization='int4' is not available here (the int4 test kernel); NF4 used"]


def test_auto_records_a_missing_kernel_without_loading_it(tiny_dir, int4_here, monkeypatch):
    timed = []
    monkeypatch.setattr(fc, "forward_ms", lambda model, fmt, n: timed.append(fmt) or {"none": 40.0}.get(fmt, 30.0) * n)
    monkeypatch.setattr(fc, "QUALITY_TOKENS", 8)
    lines = []
    lm = hf_adaspec.load(tiny_dir, dtype="float32", log=lines.append)
    assert "int4" not in timed and lm.weight_format in ("nf4", "q4")
    assert "int4 skipped (the int4 test kernel)" in lines[0] and len(lines) == 1


def test_int4_numerics_match_the_float_reference_of_its_layout():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 256, generator=gen) * torch.linspace(0.1, 3.0, 256)  # groups of different ranges
    q, sz = int4.quantize(weight)
    assert q.dtype == torch.int32 and int(q.min()) >= 0 and int(q.max()) <= 15 and sz.shape == (2, 64, 2)
    error = (int4.dequantize(q, sz) - weight).abs().reshape(64, 2, 128)
    step = sz[..., 0].float().t()[..., None]  # [N, G, 1]: each group's scale
    assert bool((error <= 0.5 * step + 0.02 * weight.abs().reshape(64, 2, 128).amax(-1, keepdim=True)).all())
    low = weight.reshape(64, 2, 128).amin(-1)
    assert torch.allclose(sz[..., 1].float().t() - 8 * sz[..., 0].float().t(), low, rtol=0.02, atol=0.02)
    nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # the bytes the CUDA packing reads: even column high
    assert torch.equal(torch.stack([nibbles >> 4, nibbles & 15], -1).reshape(64, 256).to(torch.int32), q)


@pytest.mark.parametrize("bias", [False, True])
def test_the_int4_layer_runs_torchs_kernel_as_its_dequantized_weight_would(bias):
    torch.manual_seed(1)
    layer = torch.nn.Linear(256, 64, bias=bias).to(torch.bfloat16)
    quantized = int4.Int4Linear(layer)
    x = torch.randn(2, 7, 256, dtype=torch.bfloat16)
    q, sz = int4.quantize(layer.weight)
    want = (x.float() @ int4.dequantize(q, sz).t() + (layer.bias.float() if bias else 0)).detach()  # [2, 7, 64]
    got = quantized(x)
    assert got.shape == (2, 7, 64) and got.dtype == torch.bfloat16
    assert float((got.float() - want).abs().max()) <= 0.01 * float(want.abs().max())  # bf16 accumulation
    assert torch.equal(quantized(x.float()).to(torch.bfloat16), got)  # float32 input: same kernel, same rows
    with pytest.raises(ValueError, match="in_features a multiple of 128"):
        int4.Int4Linear(torch.nn.Linear(96, 64))


# slow, both cases: the fast suite keeps q4's speculative greedy check (test_formats.py,
# test_a_q4_load_runs_the_speculative_attention_in_plain_generate_and_other_formats_keep_their_own) and the int4
# layer's kernel against its dequantized weight (test_the_int4_layer_runs_torchs_kernel_as_its_dequantized_weight_would)
@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"speculation": "adaptive"}, marks=pytest.mark.slow),
        pytest.param({"speculation": "fixed", "num_speculative_tokens": 4}, marks=pytest.mark.slow),
    ],
)
def test_int4_speculative_greedy_equals_its_own_plain_or_diverges_at_a_near_tie(tiny_dir, monkeypatch, kwargs):
    """Verifications over k + 1 rows through torch's int4 kernel (its CPU variant here) against 1-row plain steps."""
    monkeypatch.setitem(
        formats.FORMATS, "int4", dataclasses.replace(formats.FORMATS["int4"], devices=None, missing=None)
    )
    target = hf_adaspec.enable(format_load.load_weights(tiny_dir, "tiny", "int4", "float32", "cpu", False))
    assert sum(isinstance(m, int4.Int4Linear) for m in target.modules()) == 2 * 7
    draft = format_load.load_weights(tiny_dir, "tiny", "none", "float32", "cpu", False)
    gen = torch.Generator().manual_seed(3)
    for prompt in (torch.randint(1, 64, (1, 12), generator=gen), torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])):
        plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
        spec = target.generate(
            prompt,
            max_new_tokens=40,
            do_sample=False,
            assistant_model=draft,
            speculation_costs=(CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)),
            **kwargs,
        )
        gap = divergence_gap(target, plain, spec)
        assert gap is None or gap < 0.25, (kwargs, gap)


def test_converting_a_model_keeps_the_head_dense_and_its_greedy_tokens(tiny_factory):
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.05,
    )
    torch.manual_seed(2)
    dense = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.load_state_dict(dense.state_dict())
    cuda_formats.convert_int4(model, quantize_lm_head=False)
    kinds = {type(m).__name__ for m in model.modules()}
    assert "Int4Linear" in kinds and isinstance(model.get_output_embeddings(), torch.nn.Linear)
    assert sum(isinstance(m, int4.Int4Linear) for m in model.modules()) == 2 * 7  # q k v o gate up down
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, want = model(ids).logits[0].float(), dense(ids).logits[0].float()
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.75
    cuda_formats.convert_int4(model, quantize_lm_head=True)
    assert isinstance(model.get_output_embeddings(), int4.Int4Linear)


def _record(compiled: bool, replay_ms: float, kept: bool = True) -> static_kv.CaptureRecord:
    return static_kv.CaptureRecord(1, 256, 1, (), compiled, 1.0, 5.0, replay_ms, kept)


def test_a_compiled_recording_is_kept_only_where_its_replay_is_faster():
    assert static_kv.keep_compiled(_record(False, 4.0), _record(True, 3.0))
    assert not static_kv.keep_compiled(_record(False, 3.0), _record(True, 3.0))  # a tie keeps the plain recording
    assert not static_kv.keep_compiled(_record(False, 3.0), _record(True, 6.0, kept=False))
    assert static_kv.keep_compiled(_record(False, 6.0, kept=False), _record(True, 4.0))


@pytest.mark.parametrize("compiled_faster", [True, False])
def test_an_arena_that_chooses_by_time_records_a_compiled_width_both_ways(
    tiny_factory, private_cache, monkeypatch, compiled_faster
):
    """As on a GPU (``choose_by_time``): width 1 is recorded plainly and compiled (here without inductor:
    ``torch.compile`` is replaced by the plain forward), the faster replay is kept, and the tokens are plain's."""
    model = hf_adaspec.enable(tiny_factory(0))
    marker = []

    def compiled_step(*args):
        marker.append(1)
        return static_kv.block_forward(*args)

    monkeypatch.setattr(static_kv, "_compiled_block", lambda: compiled_step)
    replay_ms = {False: 4.0, True: 2.0 if compiled_faster else 6.0}  # by whether the compiled step ran
    calls = []

    def timed_ms(fn, device):  # record() times the eager forward, the capture, then REPLAY_TIMINGS replays
        before = len(marker)
        fn()
        calls.append(1)
        phase = (len(calls) - 1) % (2 + static_kv.REPLAY_TIMINGS)
        return 10.0 if phase == 0 else 1.0 if phase == 1 else replay_ms[len(marker) > before]

    monkeypatch.setattr(static_kv, "timed_ms", timed_ms)
    hf_adaspec.compile_steps(model, (1,))
    arenas_of(model).adopt(
        "target", static_kv.Arena(model, 1, 256, Rerun(), choose_by_time=True, compiled=arenas_of(model).compiled)
    )
    prompt = torch.tensor([[5, 6, 7, 8]])
    out = model.generate(
        prompt,
        speculation="fixed",
        num_speculative_tokens=0,
        speculation_costs=CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0),
        speculation_state=SpeculationState(),
        max_new_tokens=6,
        do_sample=False,
        kv_cache="static",
    )
    arena = arenas_of(model).kept("target", 1, 256)
    hf_adaspec.compile_steps(model, ())
    assert torch.equal(out, model.generate(prompt, max_new_tokens=6, do_sample=False))
    width_1 = [r for r in arena.records if r.width == 1]
    assert [r.compiled for r in width_1] == [False, True]
    assert [r.kept for r in width_1] == ([False, True] if compiled_faster else [True, False])
