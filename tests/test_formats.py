"""Weight formats and ``quantization="auto"`` (issue 44), on any processor: the choice comes from injected timings,
so no assertion depends on which kernels this machine has."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny_tokenizer, save_tiny_llama

import hf_adaspec
from hf_adaspec.backend import hf_compat
from hf_adaspec.bench.bench import divergence_gap
from hf_adaspec.models import format_choice as fc
from hf_adaspec.models import format_probe as fp
from hf_adaspec.models import format_rules as fr
from hf_adaspec.models.format_choice import FormatMeasure
from hf_adaspec.models.format_load import load_weights
from hf_adaspec.models.formats import FORMATS, format_of

pytestmark = pytest.mark.usefixtures("one_thread")
NEAR_TIE = 0.25
COSTS = hf_adaspec.CostTable(verify_ms=tuple(10.0 + n for n in range(9)), draft_ms=1.0)  # skips calibration


def _m(fmt, ms, top1=1.0):
    return FormatMeasure(fmt, ms, 2 * ms, top1, 10.0, 0.1)


def test_pick_takes_the_fastest_eligible_format():
    measures = (_m("none", 30), _m("nf4", 20, 0.95), _m("int8", 15, 0.97), _m("q4", 5, 0.94))
    assert fr.pick(measures) == "q4"  # 0.94 ≥ 0.95 − 0.02


def test_nf4_stays_unless_another_format_is_faster_beyond_the_margin():
    near = (_m("none", 30), _m("nf4", 20, 0.95), _m("q4", 20 * (1 - fr.SWITCH_MARGIN) + 0.1, 0.95))
    assert fr.pick(near) == "nf4"
    clear = (_m("none", 30), _m("nf4", 20, 0.95), _m("q4", 20 * (1 - fr.SWITCH_MARGIN) - 0.1, 0.95))
    assert fr.pick(clear) == "q4"


def test_a_format_below_the_quality_tolerance_is_not_chosen_however_fast():
    measures = (_m("none", 30), _m("nf4", 20, 0.95), _m("q4", 5, 0.90))
    assert [m.format for m in fr.eligible(measures)] == ["none", "nf4"]
    assert fr.pick(measures) == "nf4"


def test_without_nf4_the_bar_is_the_best_quantized_format():
    measures = (
        _m("none", 30),
        FormatMeasure("nf4", error="ImportError: no bitsandbytes"),
        _m("int8", 25, 0.99),
        _m("q4", 5, 0.90),
    )
    assert fr.pick(measures) == "int8"


def test_a_format_too_slow_to_be_measured_for_quality_is_not_eligible():
    measures = (_m("none", 30), _m("nf4", 20, 0.95), FormatMeasure("int8", 90.0, 180.0, None, None, 0.1))
    assert [m.format for m in fr.eligible(measures)] == ["none", "nf4"]
    assert "int8 90/180 ms over twice the best: quality not measured" in fc.FormatChoice(
        "nf4", measures, fc.cache_path({}), False, 1.0
    ).line("m")


def test_dense_weights_are_eligible_whatever_their_agreement_with_their_own_free_running_output():
    # a small bf16 model's teacher-forced argmax can leave its own batched greedy output (padding, rounding): the
    # reference itself must stay a candidate, also before any quantized format is measured
    assert fr.pick((_m("none", 30, 0.95),)) == "none"
    assert [m.format for m in fr.eligible((_m("none", 30, 0.95), _m("nf4", 20, 0.99)))] == ["none", "nf4"]


def test_pick_names_every_error_when_nothing_loaded():
    measures = (
        FormatMeasure("none", error="OSError: disk"),
        FormatMeasure("q4", error="KernelUnavailable: no compiler"),
    )
    with pytest.raises(ValueError, match="none: OSError: disk; q4: KernelUnavailable: no compiler"):
        fr.pick(measures)


def _head(fmt, ms, top1=1.0):
    return FormatMeasure(fmt, ms, 2 * ms, top1, 10.0, 0.1, head=True)


def test_the_quantized_head_is_kept_only_when_eligible_and_faster_beyond_the_margin():
    base = (_m("none", 30), _m("nf4", 20, 0.95), _m("q4", 10, 0.95))
    assert fr.pick((*base, _head("q4", 1, 0.99))) == "q4"  # a head variant is never pick's candidate
    assert fr.keep_head((*base, _head("q4", 10 * (1 - fr.SWITCH_MARGIN) - 0.1, 0.94)), "q4")
    assert not fr.keep_head((*base, _head("q4", 10 * (1 - fr.SWITCH_MARGIN) + 0.1, 0.95)), "q4")  # within the margin
    assert not fr.keep_head((*base, _head("q4", 5, 0.92)), "q4")  # below NF4's agreement − tolerance
    assert not fr.keep_head((*base, FormatMeasure("q4", error="RuntimeError: x", head=True)), "q4")
    assert not fr.keep_head(base, "q4")  # not measured
    with_nf4_head = (_m("none", 30), _head("nf4", 5, 0.99), _m("nf4", 20, 0.90), _m("q4", 10, 0.89))
    assert [m.format for m in fr.eligible(with_nf4_head) if not m.head] == ["none", "nf4", "q4"]  # bar: 0.90 − 0.02


def test_a_format_twice_the_best_is_timed_once():
    calls = []

    def timer(model, fmt, n):
        calls.append(n)
        return 100.0 * n

    assert fp.time_format(None, "x", timer, best_ms=90.0) == (100.0, 600.0, False)  # score 200 > 2 × 90
    assert calls == [1, fp.PROBE_K + 1]
    calls.clear()
    fp.time_format(None, "x", timer, best_ms=1000.0)
    assert len(calls) == 2 * fp.PROBE_REPS


@pytest.fixture
def tiny_dir(tmp_path, private_cache):
    """A tiny Llama (64 wide: every linear fits q4's groups of 32 and NF4's blocks) and its tokenizer, saved."""
    return save_tiny_llama(tmp_path / "tiny", 64)


INJECTED = {"none": 40.0, "nf4": 30.0, "int8": 20.0, "q4": 10.0}


def _timer(model, fmt, n):
    return INJECTED[fmt] * n


def test_auto_loads_the_fastest_format_reports_it_in_one_line_and_caches_it(tiny_dir, monkeypatch):
    monkeypatch.setattr(fc, "forward_ms", _timer)
    monkeypatch.setattr(fc, "QUALITY_TOKENS", 8)
    lines = []
    lm = hf_adaspec.load(tiny_dir, dtype="float32", log=lines.append)
    assert lm.weight_format == "q4"
    assert any(type(m).__name__ == "Q4Linear" for m in lm.model.modules())
    assert len(lines) == 1 and "weights q4" in lines[0] and "none 40/240 ms" in lines[0]
    monkeypatch.setattr(fc, "forward_ms", None)  # a second load reads the cache: nothing is timed
    again = hf_adaspec.load(tiny_dir, dtype="float32", log=lines.append)
    assert again.weight_format == "q4" and "cached in" in lines[1] and "probe" not in lines[1]


def _head_quantized(model) -> bool:
    return type(model.get_output_embeddings()).__name__ == "Q4Linear"


# the fast suite keeps test_the_quantized_head_is_kept_only_when_eligible_and_faster_beyond_the_margin and
# test_a_q4_head_put_on_a_loaded_dense_source_model_is_the_head_a_load_with_it_gives
@pytest.mark.slow  # a full probe with the head variant, twice
def test_auto_quantizes_the_chosen_formats_head_where_that_is_faster(tiny_dir, monkeypatch):
    """The chosen format is measured again with its output head quantized; that variant is loaded (and cached)
    when its score is beyond the margin, and never measured when the caller quantizes the head itself."""
    timed = []

    def timer(model, fmt, n):
        timed.append((fmt, _head_quantized(model)))
        return INJECTED[fmt] * n * (0.5 if _head_quantized(model) else 1.0)

    monkeypatch.setattr(fc, "forward_ms", timer)
    monkeypatch.setattr(fc, "QUALITY_TOKENS", 8)
    lines = []
    lm = hf_adaspec.load(tiny_dir, dtype="float32", log=lines.append)
    assert lm.weight_format == "q4" and lm.quantized_head and _head_quantized(lm.model)
    assert lm.format_label == "q4 + head"
    assert "weights q4 + quantized head" in lines[0] and "; q4 + quantized head 5/30 ms top-1" in lines[0]
    assert {f for f, head in timed if head} == {"q4"}  # only the chosen format's variant
    monkeypatch.setattr(fc, "forward_ms", None)  # from the cache: nothing timed, the head quantized again
    again = hf_adaspec.load(tiny_dir, dtype="float32", log=lines.append)
    assert again.quantized_head and _head_quantized(again.model) and "cached in" in lines[1]
    timed.clear()
    choice, model = fc.choose(
        tiny_dir,
        "tiny",
        build_tiny_tokenizer(),
        "float32",
        quantize_lm_head=True,
        timer=timer,
        quality_tokens=8,
        formats=("q4", "none"),
    )
    assert not choice.head and not any(m.head for m in choice.measures) and _head_quantized(model)


def test_a_q4_head_put_on_a_loaded_dense_source_model_is_the_head_a_load_with_it_gives(tiny_dir):

    ids = torch.randint(1, 64, (2, 10), generator=torch.Generator().manual_seed(5))
    swapped = load_weights(tiny_dir, "tiny", "q4", "float32", "cpu", False)
    swapped.set_output_embeddings(FORMATS["q4"].quantize_head(swapped, tiny_dir))
    loaded = load_weights(tiny_dir, "tiny", "q4", "float32", "cpu", True)
    with torch.inference_mode():
        assert torch.equal(swapped(ids).logits, loaded(ids).logits) and _head_quantized(swapped)


# the fast suite keeps test_pick_names_every_error_when_nothing_loaded (a format's error in the choice)
@pytest.mark.slow  # a full probe
def test_a_format_that_fails_is_skipped_with_its_reason(tiny_dir):
    def timer(model, fmt, n):
        if fmt == "q4":
            raise RuntimeError("no kernel for this tensor\nsecond line")
        return INJECTED[fmt] * n

    choice, model = fc.choose(
        tiny_dir,
        "tiny",
        build_tiny_tokenizer(),
        "float32",
        timer=timer,
        quality_tokens=8,
        formats=("q4", "int8", "none"),
    )
    assert choice.chosen == "int8" and model is not None
    assert "q4 skipped (RuntimeError: no kernel for this tensor)" in choice.line("tiny")


# the fast suite keeps test_auto_loads_the_fastest_format_reports_it_in_one_line_and_caches_it (the cache read back),
# test_a_changed_q4_kernel_measures_its_choice_and_its_costs_again (the key); the digest: files.read_json_verified
@pytest.mark.slow  # two full probes
def test_the_cache_key_holds_the_machine_and_a_bad_cache_file_is_measured_again(tiny_dir):
    key = fc.probe_key("m", "src", "bfloat16", "cpu", False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if before != 1 else 2)
        assert fc.cache_path(fc.probe_key("m", "src", "bfloat16", "cpu", False)) != fc.cache_path(key)
    finally:
        torch.set_num_threads(before)
    assert {"processor", "threads", "aten_cpu", "versions"} <= set(key)
    assert fc.cache_path(fc.probe_key("m", "src", "bfloat16", "cpu", True)) != fc.cache_path(key)
    choice, _ = fc.choose(
        tiny_dir, "tiny", build_tiny_tokenizer(), "float32", timer=_timer, quality_tokens=8, formats=("q4", "none")
    )
    choice.path.write_text(choice.path.read_text().replace('"q4"', '"none"', 1))  # edited: the digest fails
    again, model = fc.choose(
        tiny_dir, "tiny", build_tiny_tokenizer(), "float32", timer=_timer, quality_tokens=8, formats=("q4", "none")
    )
    assert not again.cached and again.chosen == "q4" and model is not None


def test_a_changed_q4_kernel_measures_its_choice_and_its_costs_again(tiny_dir, monkeypatch):
    """The kernel's source (and, in the cost identity, its code path) is in the probe's key and in the cost identity
    of a pair with q4 layers (only there: profiles of other formats stay valid), so a new kernel is never priced with
    the old one's times."""
    from hf_adaspec.costs.table import pair_identity
    from hf_adaspec.kernels import q4

    q4_model = load_weights(tiny_dir, "tiny", "q4", "float32", "cpu", False)
    dense = load_weights(tiny_dir, "tiny", "none", "float32", "cpu", False)
    key, with_q4, without = (
        fc.probe_key("m", "src", "bfloat16", "cpu", False),
        pair_identity(dense, q4_model),
        pair_identity(dense, None),
    )
    assert with_q4["q4_kernel"] == key["q4_kernel"] == q4.source_tag() and "q4_kernel" not in without
    monkeypatch.setattr(q4, "source_tag", lambda: "another kernel")
    assert fc.cache_path(fc.probe_key("m", "src", "bfloat16", "cpu", False)) != fc.cache_path(key)
    assert pair_identity(dense, q4_model) == {**with_q4, "q4_kernel": "another kernel"}
    assert pair_identity(dense, None) == without
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # the path is in the identity: plain C is timed apart
    assert pair_identity(dense, q4_model)["q4_path"] == "portable" and "q4_path" not in without


def test_explicit_formats_are_honoured_without_a_probe(tiny_dir, monkeypatch):
    monkeypatch.setattr(fc, "choose", None)  # any call would fail
    for fmt, kind in (("int8", "Int8Params"), ("q4", "Q4Linear"), ("none", "Parameter")):
        lm = hf_adaspec.load(tiny_dir, quantization=fmt, dtype="float32")
        assert lm.weight_format == fmt
        kinds = {type(p).__name__ for p in lm.model.parameters()} | {type(m).__name__ for m in lm.model.modules()}
        assert kind in kinds


def test_a_q4_load_runs_the_speculative_attention_in_plain_generate_and_other_formats_keep_their_own(tiny_dir):
    """``hf_adaspec.load`` gives a q4 model the packed, lean attention as its own, so plain ``generate`` runs what
    speculative requests run (float32: the same greedy tokens as speculation); other formats keep sdpa."""
    lm = hf_adaspec.load(tiny_dir, quantization="q4", dtype="float32")
    model = hf_adaspec.enable(lm.model)
    lean = [m for m in model.modules() if isinstance(m, hf_compat.lean_attention.LeanAttention)]
    assert model.config._attn_implementation == hf_compat.PACKED_SDPA and len(lean) == model.config.num_hidden_layers
    prompt = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(3))
    plain = model.generate(prompt, max_new_tokens=12, do_sample=False)
    spec = model.generate(
        prompt, max_new_tokens=12, do_sample=False, assistant_model=model, speculation="fixed", num_speculative_tokens=3
    )
    assert torch.equal(spec, plain)
    assert model.config._attn_implementation == hf_compat.PACKED_SDPA  # speculation swapped nothing out
    assert [m for m in model.modules() if isinstance(m, hf_compat.lean_attention.LeanAttention)] == lean
    dense = hf_adaspec.load(tiny_dir, quantization="none", dtype="float32").model
    assert dense.config._attn_implementation == "sdpa"
    assert not any(isinstance(m, hf_compat.lean_attention.LeanAttention) for m in dense.modules())


def test_formats_refuse_what_they_cannot_do():
    with pytest.raises(ValueError, match="runs on cpu only"):
        format_of("q4", "cuda")
    with pytest.raises(ValueError, match="choose one of"):
        hf_adaspec.load("x", quantization="int3")
    with pytest.raises(ValueError, match="with random weights give a format"):
        from hf_adaspec.models.architecture import load_architecture

        load_architecture("smollm2-135m", quantization="auto")


# all slow: the fast suite keeps q4's speculative greedy equal to its plain greedy in
# test_a_q4_load_runs_the_speculative_attention_in_plain_generate_and_other_formats_keep_their_own (make test: each)
CPU_FORMATS = sorted(f for f, w in FORMATS.items() if w.devices is None or "cpu" in w.devices)


@pytest.mark.slow  # four formats, each two prompts × three requests of 40 tokens
@pytest.mark.parametrize("fmt", CPU_FORMATS)
def test_each_format_speculative_greedy_equals_its_own_plain_or_diverges_at_a_near_tie(tiny_dir, fmt):
    """Each format made for a CPU (the GPU formats: test_cuda_formats, through torch's CPU int4 kernel)."""
    target = hf_adaspec.enable(load_weights(tiny_dir, "tiny", fmt, "float32", "cpu", False))
    draft = load_weights(tiny_dir, "tiny", "none", "float32", "cpu", False)
    gen = torch.Generator().manual_seed(3)
    for prompt in (torch.randint(1, 64, (1, 12), generator=gen), torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])):
        plain = target.generate(prompt, max_new_tokens=40, do_sample=False)
        for kwargs in ({"speculation": "adaptive"}, {"speculation": "fixed", "num_speculative_tokens": 4}):
            spec = target.generate(
                prompt, max_new_tokens=40, do_sample=False, assistant_model=draft, speculation_costs=COSTS, **kwargs
            )
            gap = divergence_gap(target, plain, spec)
            assert gap is None or gap < NEAR_TIE, (fmt, kwargs, gap)


def test_the_probe_prefills_once_per_model_and_crops_back_after_each_timed_forward(tiny_dir):
    model = load_weights(tiny_dir, "tiny", "none", "float32", "cpu", False)
    widths = []
    model.register_forward_pre_hook(
        lambda mod, args, kwargs: widths.append((args or [kwargs.get("input_ids")])[0].shape[1]), with_kwargs=True
    )
    times = [fp.forward_ms(model, "none", n) for n in (1, fp.PROBE_K + 1, 1, fp.PROBE_K + 1)]
    assert all(t > 0 for t in times)
    assert widths == [fp.PROBE_CONTEXT, 1, 1, fp.PROBE_K + 1, fp.PROBE_K + 1, 1, fp.PROBE_K + 1]
    assert fp._PREFILLED[model][1].get_seq_length() == fp.PROBE_CONTEXT
    widths.clear()
    fp.rewarm(model)  # a module replaced (the quantized head): each width runs untimed once more
    fp.forward_ms(model, "none", 1)
    assert widths == [1, 1]
