"""The q4 kernel (``kernels/q4``, ``kernels/blocks``): GGUF blocks read bit for bit, the integer matmul against its
exact emulation in float64, the plain-C path against the vector ones (AVX-VNNI against AVX2 bit for bit where the CPU
has it), the path chosen from the CPU's flags, fused segments, the layer, and the errors that name a fix. Built once per
session into a temporary directory (conftest's ``kernel_dir``)."""

from __future__ import annotations

import copy
import os
import stat

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import dequantize as gguf_dequantize

from hf_adaspec.kernels import blocks, fused, q4, q4_layer

SIZES = {"Q4_K": (144, 256), "Q6_K": (210, 256), "Q8_0": (34, 32), "Q5_0": (22, 32), "Q4_0": (18, 32)}


@pytest.fixture
def kdir(kernel_dir):
    return kernel_dir


def random_gguf(gguf_type: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random GGUF rows of ``gguf_type`` [N, bytes]: every code and scale byte random, fp16 scales finite (some
    zero, some subnormal, some negative where the type allows)."""
    rng = np.random.default_rng(seed)
    size, per = SIZES[gguf_type]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    d = (rng.standard_normal((n, k // per, 2)) * 0.02).astype(np.float16)
    d[..., 0].flat[::7] = 0
    d[..., 0].flat[1::11] = np.float16(3e-6)  # subnormal
    if gguf_type == "Q4_K":
        raw[..., 0:4] = np.abs(d).view(np.uint8).reshape(n, k // per, 4)
    elif gguf_type == "Q6_K":
        raw[..., 208:210] = d[..., :1].view(np.uint8).reshape(n, k // per, 2)
    else:
        raw[..., 0:2] = d[..., :1].view(np.uint8).reshape(n, k // per, 2)
    return raw.reshape(n, -1)


def gguf_rows(gguf_type: str, n: int, k: int, seed: int, directory) -> tuple[str, torch.Tensor]:
    """(kind, rows) of random GGUF rows (``random_gguf``) in the kernel's layout (converted by the kernel built in
    ``directory``)."""
    return q4.from_gguf(gguf_type, random_gguf(gguf_type, n, k, seed), k, directory)


@pytest.mark.parametrize(
    "gguf_type,k", [("Q4_K", 512), ("Q6_K", 768), ("Q8_0", 96), ("Q8_0", 512), ("Q5_0", 896), ("Q4_0", 64)]
)
def test_gguf_blocks_dequantize_bit_for_bit_as_gguf_does(kdir, gguf_type, k):
    raw = random_gguf(gguf_type, 12, k, seed=k)
    kind, rows = q4.from_gguf(gguf_type, raw, k, kdir)
    assert rows.shape == (12, blocks.row_bytes(kind, k)) and rows.dtype == torch.uint8
    ours = blocks.dequantize(kind, rows, k)
    theirs = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[gguf_type]).reshape(12, k))
    assert torch.equal(ours, theirs)


def _emulated(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: activations to int8 per 256 features (scale max|x| / 127, round half
    to even), times the dequantized weight w [N, K] exactly."""
    m, k = x.shape
    xdeq = _quantized(x).double()[:, :k]
    return (xdeq @ w.double().T).float()


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernel quantizes it, in float32: per 256 features (zeros past K) the codes round(x · 127 /
    max|x|) (half to even; 127 / max|x| one float32 division, as in C) times max|x| / 127 → [M, padded K]."""
    m, k = x.shape
    kp = blocks.padded(k)
    xb = torch.nn.functional.pad(x.float(), (0, kp - k)).view(m, -1, blocks.BLOCK)  # [M, B, 256]
    amax = xb.abs().amax(-1, keepdim=True)  # [M, B, 1]
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # not 127 / amax:
    return ((xb * inv).round() * (amax / 127)).view(m, kp)  # torch takes that as 127 times amax's reciprocal


def _layer(parts, k, kdir, bias=None):
    return q4_layer.Q4Linear(k, parts, bias, kdir)


@pytest.mark.parametrize("ceiling", q4.PATHS)
@pytest.mark.parametrize("gguf_type,k", [("Q4_K", 512), ("Q6_K", 256), ("Q8_0", 96), ("Q5_0", 288)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 9, 17])
def test_matmul_equals_its_emulation(kdir, gguf_type, k, m, ceiling):
    torch.manual_seed(m * 1000 + k)
    kind, rows = gguf_rows(gguf_type, 24, k, m + k, kdir)
    x = torch.randn(m, k)
    y = q4.linear(
        x,
        rows.reshape(-1),
        torch.tensor([blocks.KINDS.index(kind)], dtype=torch.int32),
        torch.tensor([24]),
        k,
        kdir,
        ceiling=ceiling,
    )  # [M, N]
    ref = _emulated(x, blocks.dequantize(kind, rows, k))
    assert y.shape == (m, 24) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("ceiling", q4.PATHS[1:])
def test_plain_c_and_the_vector_paths_agree_within_float_rounding(kdir, ceiling):
    """The paths differ only in the order of float additions; each runs where the CPU has it, else the best path
    below it (tests must not depend on the processor)."""
    torch.manual_seed(7)
    k = 768
    parts = [gguf_rows(t, 20, k, i, kdir) for i, t in enumerate(("Q4_K", "Q6_K", "Q8_0"))]
    layer, x = _layer(parts, k, kdir), torch.randn(11, k)
    fast = q4.linear(x, layer.blocks, layer.kind_ids, layer.rows, k, kdir, ceiling=ceiling)
    plain = q4.linear(x, layer.blocks, layer.kind_ids, layer.rows, k, kdir, ceiling="portable")
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5 * float(plain.abs().max()))


@pytest.mark.parametrize("ceiling", q4.PATHS)
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(kdir, ceiling):
    """Verification multiplies k + 1 rows where a plain step multiplies one: each row's result is bit for bit its
    result alone, on every path and every row count (rows go 4 or 8 at a time)."""
    torch.manual_seed(9)
    k = 768
    parts = [gguf_rows(t, 20, k, i, kdir) for i, t in enumerate(("Q4_K", "Q6_K", "Q8_0"))]
    layer, x = _layer(parts, k, kdir), torch.randn(11, k).to(torch.bfloat16)
    args = (layer.blocks, layer.kind_ids, layer.rows, k, kdir)
    together = q4.linear(x, *args, ceiling=ceiling)  # [11, 60]
    for i in range(11):
        assert torch.equal(together[i : i + 1], q4.linear(x[i : i + 1], *args, ceiling=ceiling))


@pytest.mark.parametrize("ceiling", q4.PATHS)
def test_a_long_prompts_rows_taken_in_passes_are_each_their_product_alone(kdir, ceiling, monkeypatch):
    """A prefill's rows meet the weights a few dozen at a time (as many as fit in cache: 24 at 4096 features), the
    last pass shorter; every row of ``linear`` and of ``swiglu`` is still bit for bit its result alone."""
    monkeypatch.setenv(q4.PATH_ENV, ceiling)
    torch.manual_seed(11)
    k, m = 4096, 61  # passes of 24, 24, 13 rows
    gate, up = gguf_rows("Q4_K", 16, k, 1, kdir), gguf_rows("Q6_K", 16, k, 2, kdir)
    layer, x = _layer([gate, up], k, kdir), torch.randn(m, k).to(torch.bfloat16)
    together, swiglu = layer(x), layer.swiglu(x)  # [61, 32], [61, 16]
    for i in range(m):
        assert torch.equal(together[i : i + 1], layer(x[i : i + 1]))
        assert torch.equal(swiglu[i : i + 1], layer.swiglu(x[i : i + 1]))


def test_the_path_follows_the_cpu_capped_by_aten_cpu_capability_and_the_ceiling(kdir, monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv(q4.PATH_ENV, raising=False)
    best = q4.path(kdir)
    assert best in q4.PATHS and q4.path(kdir, "portable") == "portable"
    assert q4.path(kdir, "avx2") == min(best, "avx2", key=q4.PATHS.index)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert q4.path(kdir) == min(best, "avx2", key=q4.PATHS.index)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert q4.path(kdir) == "portable"
    with pytest.raises(ValueError, match="no q4 kernel path 'avx3': choose one of portable, avx2, avx_vnni, avx512"):
        q4.path(kdir, "avx3")


AVX2_ONLY = {"avx", "avx2", "fma", "f16c"}
ALDER_LAKE = AVX2_ONLY | {"avx_vnni"}
CASCADE_LAKE = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512cd", "avx512_vnni"}
ZEN5 = CASCADE_LAKE | {"avx_vnni", "avx512_bf16"}


@pytest.mark.parametrize(
    "flags,ceiling,chosen",
    [
        (set(), "avx512_vnni", "portable"),
        ({"avx2", "avx_vnni"}, "avx512_vnni", "portable"),  # no FMA: not even the AVX2 path
        (AVX2_ONLY, "avx512_vnni", "avx2"),
        (ALDER_LAKE, "avx512_vnni", "avx_vnni"),
        (ALDER_LAKE, "avx2", "avx2"),
        (CASCADE_LAKE, "avx512_vnni", "avx512_vnni"),
        (CASCADE_LAKE, "avx_vnni", "avx2"),  # AVX-512 VNNI does not imply AVX-VNNI
        (CASCADE_LAKE - {"avx512bw"}, "avx512_vnni", "avx2"),
        (ZEN5, "avx512_vnni", "avx512_vnni"),
        (ZEN5, "avx_vnni", "avx_vnni"),
        (ZEN5, "portable", "portable"),
    ],
)
def test_the_path_is_the_fastest_whose_instructions_the_flags_name(flags, ceiling, chosen):
    assert q4.choose(flags, ceiling) == chosen


def test_the_kernel_chooses_as_choose_does_and_the_environment_caps_it(kdir, monkeypatch):
    """The C side's own choice (q4_isa, and the path q4_linear runs for each ceiling) is ``choose`` over the flags it
    detects; ``HF_ADASPEC_Q4_PATH`` names the fastest path to take, in place of ``ATEN_CPU_CAPABILITY``'s cap."""
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv(q4.PATH_ENV, raising=False)
    flags = q4.cpu_flags(kdir)
    assert flags <= set(q4.FLAGS)
    assert q4.PATHS[q4.library(kdir).q4_isa()] == q4.choose(flags) == q4.path(kdir)
    for ceiling in q4.PATHS:
        assert q4.path(kdir, ceiling) == q4.choose(flags, ceiling)
        monkeypatch.setenv(q4.PATH_ENV, ceiling)
        assert q4.path(kdir) == q4.choose(flags, ceiling)
        assert q4.path(kdir, "avx2") == q4.choose(flags, min(ceiling, "avx2", key=q4.PATHS.index))
        monkeypatch.delenv(q4.PATH_ENV)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # torch's cap, unless the kernel's own variable names one
    assert q4.path(kdir) == q4.choose(flags, "avx2")
    monkeypatch.setenv(q4.PATH_ENV, "avx_vnni")
    assert q4.path(kdir) == q4.choose(flags, "avx_vnni")
    monkeypatch.setenv(q4.PATH_ENV, "avx3")
    with pytest.raises(ValueError, match="HF_ADASPEC_Q4_PATH='avx3' is no q4 kernel path: choose one of portable"):
        q4.path(kdir)


def _identity_q8_0(k: int) -> np.ndarray:
    """GGUF Q8_0 rows [k, bytes] of the k × k identity: row n's code at feature n is 1, every block's d is 1."""
    raw = np.zeros((k, k // 32, 34), dtype=np.uint8)
    raw[:, :, 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    raw[np.arange(k), np.arange(k) // 32, 2 + np.arange(k) % 32] = 1
    return raw.reshape(k, -1)


@pytest.mark.parametrize("ceiling", q4.PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activations_are_quantized_as_the_emulation_on_every_path(kdir, ceiling, dtype):
    """Times the identity each output is one activation's code times its block's scale (qx · max|x| / 127, one
    rounding), so every path's quantizer (plain C, AVX2) is compared code for code: round half to even (ties
    included), a zero block, a width that is not whole blocks, and enough blocks to split over threads."""
    k, m = 608, 30  # 3 blocks a row, the last part zeros; 90 blocks
    kind, rows = q4.from_gguf("Q8_0", _identity_q8_0(k), k, kdir)
    layer = _layer([(kind, rows)], k, kdir)
    torch.manual_seed(12)
    x = torch.randn(m, k) * torch.rand(m, 1) * 8
    x[0, :256] = torch.arange(256) % 9 - 4.5
    x[0, 0] = 127.0  # the block's scale 1: its halves are ties
    x[1, 256:512] = 0.0
    x = x.to(dtype)
    y = q4.linear(x, layer.blocks, layer.kind_ids, layer.rows, k, kdir, ceiling=ceiling)  # [M, K]
    assert torch.equal(y, _quantized(x)[:, :k].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_the_avx_vnni_path_is_the_avx2_path_bit_for_bit(kdir, m, dtype):
    """vpdpbusd's exact int32 group sums times the int32 scales are the integers AVX2's maddubs and madd give, and the
    float operations after are the same: equal results, every kind and row count. Runs where the CPU has AVX-VNNI."""
    if q4.path(kdir, "avx_vnni") != "avx_vnni":
        pytest.skip("this CPU (or compiler) has no AVX-VNNI path")
    torch.manual_seed(m)
    k = 768
    parts = [gguf_rows(t, 20, k, i, kdir) for i, t in enumerate(("Q4_K", "Q6_K", "Q8_0", "Q5_0"))]
    layer, x = _layer(parts, k, kdir), (torch.randn(m, k) * torch.rand(m, 1) * 4).to(dtype)
    args, bias = (layer.blocks, layer.kind_ids, layer.rows, k, kdir), torch.randn(80)
    vnni = q4.linear(x, *args, bias=bias, ceiling="avx_vnni")  # [m, 80]
    assert vnni.dtype == dtype and torch.equal(vnni, q4.linear(x, *args, bias=bias, ceiling="avx2"))


def test_segments_of_several_kinds_are_the_separate_products_side_by_side(kdir):
    """A fused matrix (a Q4_K query beside a Q6_K value) gives, row for row, each part's own product."""
    torch.manual_seed(8)
    k = 512
    parts = [gguf_rows("Q4_K", 16, k, 1, kdir), gguf_rows("Q6_K", 8, k, 2, kdir), gguf_rows("Q4_K", 4, k, 3, kdir)]
    x = torch.randn(5, k)
    fused = _layer(parts, k, kdir)(x)  # [5, 28]
    alone = torch.cat([_layer([p], k, kdir)(x) for p in parts], -1)
    assert fused.shape == (5, 28) and torch.equal(fused, alone)
    torch.testing.assert_close(
        fused, _emulated(x, _layer(parts, k, kdir).weight_float()), rtol=1e-4, atol=1e-4 * float(fused.abs().max())
    )


@pytest.mark.parametrize("ceiling", q4.PATHS)
def test_bfloat16_in_and_out_with_bias_is_the_float_result_rounded_once(kdir, ceiling):
    """bf16 activations are read in place and the bias is added before the one rounding to bf16: bit for bit what
    the float32 path plus the bias, then torch's rounding, gives."""
    torch.manual_seed(3)
    bias, x = torch.randn(40), torch.randn(5, 544).to(torch.bfloat16)
    layer = q4_layer.Q4Linear.dense(torch.nn.Linear(544, 40), kdir)
    args = (layer.blocks, layer.kind_ids, layer.rows, 544, kdir)
    y = q4.linear(x, *args, bias=bias, ceiling=ceiling)  # [5, 40]
    ref = q4.linear(x.float(), *args, ceiling=ceiling) + bias
    assert y.dtype == torch.bfloat16 and y.shape == (5, 40)
    assert torch.equal(y, ref.to(torch.bfloat16))
    assert not torch.equal(y, q4.linear(x, *args, ceiling=ceiling))  # the bias was added


def test_other_dtypes_go_through_float32_and_too_wide_inputs_are_refused(kdir):
    layer = q4_layer.Q4Linear.dense(torch.nn.Linear(256, 8, bias=False), kdir)
    x = torch.randn(2, 200)  # fewer features than the weight: the rest are zeros
    args = (layer.blocks, layer.kind_ids, layer.rows, 256, kdir)
    half = q4.linear(x.half(), *args)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, q4.linear(x.half().float(), *args), rtol=0, atol=0)
    with pytest.raises(ValueError, match="300 input features but the packed weight holds 256"):
        q4.linear(torch.randn(1, 300), *args)


def test_a_bias_of_another_dtype_and_an_empty_input(kdir):
    torch.manual_seed(5)
    layer, bias, x = q4_layer.Q4Linear.dense(torch.nn.Linear(256, 16), kdir), torch.randn(16), torch.randn(3, 256)
    args = (layer.blocks, layer.kind_ids, layer.rows, 256, kdir)
    torch.testing.assert_close(
        q4.linear(x, *args, bias=bias.to(torch.bfloat16)),
        q4.linear(x, *args, bias=bias.to(torch.bfloat16).float()),
        rtol=0,
        atol=0,
    )
    assert q4.linear(x[:0], *args, bias=bias).shape == (0, 16)


def test_q4_linear_reads_strided_inputs_as_their_values(kdir):
    torch.manual_seed(4)
    layer = q4_layer.Q4Linear.dense(torch.nn.Linear(64, 16).to(torch.bfloat16), kdir)
    x = torch.randn(3, 128, dtype=torch.bfloat16)[:, ::2]  # [3, 64], not contiguous
    assert torch.equal(layer(x), layer(x.contiguous()))


def test_quantize_q4_k_rounds_each_weight_near_its_groups_grid():
    torch.manual_seed(0)
    w = torch.randn(16, 320)
    back = blocks.dequantize("q4_k", blocks.quantize_q4_k(w), 320)
    groups = torch.nn.functional.pad(w, (0, 192)).view(16, -1, 32)[:, :10]  # [16, 10, 32]
    step = (groups.amax(-1) - groups.amin(-1).clamp(max=0)) / 15
    err = (back - w).abs().view(16, 10, 32)
    assert back.shape == w.shape
    assert bool((err <= step[..., None] * 0.5 + step.amax() / 63 * 16).all())  # half a level + the 6-bit scales
    assert float(err.mean()) > 0 and float(err.mean()) < 0.25 * float(step.mean())  # 4 bits: close, not lossless


def test_quantize_q8_0_is_half_a_step_from_each_weight():
    torch.manual_seed(1)
    w = torch.randn(8, 96)
    back = blocks.dequantize("q8_0", blocks.quantize_q8_0(w), 96)
    step = w.view(8, 3, 32).abs().amax(-1) / 127
    assert bool(((back - w).abs().view(8, 3, 32) <= step[..., None] * 0.5 + 1e-3 * step[..., None]).all())


def test_widths_that_are_not_whole_groups_and_wrong_layouts_are_refused(kdir):
    with pytest.raises(ValueError, match="multiple of 32"):
        blocks.quantize_q4_k(torch.randn(4, 40))
    with pytest.raises(ValueError, match=r"q6_k rows of 256 features are uint8 \[N, 210\]"):
        q4_layer.Q4Linear(256, [("q6_k", torch.zeros(2, 148, dtype=torch.uint8))], None, kdir)
    with pytest.raises(ValueError, match="GGUF Q5_K has no exact layout"):
        q4.from_gguf("Q5_K", np.zeros((1, 176), np.uint8), 256, kdir)
    with pytest.raises(ValueError, match="rows of 140 bytes do not hold 256 features"):
        q4.from_gguf("Q4_K", np.zeros((1, 140), np.uint8), 256, kdir)


def test_q4_linear_keeps_shape_dtype_and_bias_and_approximates_the_dense_layer(kdir):
    torch.manual_seed(1)
    dense = torch.nn.Linear(96, 40).to(torch.bfloat16)
    layer = q4_layer.Q4Linear.dense(dense, kdir)
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    ref = dense(x).float()
    assert float((y.float() - ref.detach()).norm() / ref.detach().norm()) < 0.1
    nobias = q4_layer.Q4Linear.dense(torch.nn.Linear(96, 40, bias=False), kdir)
    assert nobias.bias is None and "bias=False" in repr(nobias) and "kinds=q4_k" in repr(nobias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layers_bound_call_is_linears_product_and_rebinds_after_a_copy_or_cast(kdir, dtype):
    """``Q4Linear.forward`` binds the kernel call once per layer: bit for bit ``q4.linear``'s product (2-D, 3-D and
    strided inputs, with a bias), and a copy, a cast or a replaced bias binds its own buffers, not the old ones."""
    torch.manual_seed(6)
    layer = q4_layer.Q4Linear.dense(torch.nn.Linear(256, 24), kdir)

    def reference(module, x):
        b = module._buffers
        flat = x.reshape(-1, 256)
        return q4.linear(flat, b["blocks"], b["kind_ids"], b["rows"], 256, kdir, b["bias"]).view(*x.shape[:-1], 24)

    for x in (torch.randn(3, 256, dtype=dtype), torch.randn(2, 5, 256, dtype=dtype), torch.randn(4, 512)[:, ::2]):
        assert torch.equal(layer(x), reference(layer, x))
    copied = copy.deepcopy(layer)
    copied.bias.mul_(2.0)  # its own buffer: the layer it was copied from keeps its bias
    x = torch.randn(2, 256, dtype=dtype)
    assert torch.equal(copied(x), reference(copied, x)) and torch.equal(layer(x), reference(layer, x))
    assert not torch.equal(copied(x), layer(x))
    layer.bias = torch.zeros(24)  # a replaced buffer is bound anew
    assert torch.equal(layer(x), reference(layer, x))
    halved = layer.to(torch.bfloat16)  # the bias buffer cast: read as float32 again
    assert torch.equal(halved(x), reference(halved, x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_silu_of_the_gate_rows_times_the_up_rows(kdir, dtype):
    """``Q4Linear.swiglu`` of a layer of gate rows then up rows, with a bias: torch's silu(g) · u on the layer's
    output (float32 within a relative 1e-6, bfloat16 within a unit in the last place); a row's output alone is its
    output beside others; odd rows and the dense route's row counts give None (``forward``'s route then)."""
    torch.manual_seed(3)
    gate, up = torch.nn.Linear(512, 200), torch.nn.Linear(512, 200)  # 200 features: threads' ranges and a tail
    layer, _ = fused.stack([q4_layer.Q4Linear.dense(gate, kdir), q4_layer.Q4Linear.dense(up, kdir)], kdir)
    x = (torch.randn(7, 512) * 4).to(dtype)
    y = layer(x)  # [7, 400]
    want, got = (torch.nn.functional.silu(y[:, :200]) * y[:, 200:]).float(), layer.swiglu(x)
    assert got.shape == (7, 200) and got.dtype == dtype
    bound = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
    assert ((got.float() - want).abs() <= bound * want.abs() + 1e-6 * float(want.abs().max())).all()
    for i in range(7):
        assert torch.equal(layer.swiglu(x[i : i + 1]), got[i : i + 1])
    assert q4_layer.Q4Linear.dense(torch.nn.Linear(512, 25), kdir).swiglu(x) is None
    layer.dense_rows = 4
    assert layer.swiglu(x) is None and layer.swiglu(x[:3]) is not None


def test_a_missing_compiler_is_named_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with pytest.raises(q4.KernelUnavailable, match="apt install gcc"):
        q4.build(tmp_path / "k")


def test_a_failing_compiler_reports_its_message_and_leaves_nothing(tmp_path, monkeypatch):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\necho 'cc: fatal: out of luck' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(cc))
    with pytest.raises(q4.KernelUnavailable, match="out of luck"):
        q4.build(tmp_path / "k")
    assert os.listdir(tmp_path / "k") == []


def test_a_build_is_reused(kdir):
    first = q4.build(kdir)
    assert q4.build(kdir) == first and first.stat().st_size > 0


def test_tensors_off_the_cpu_are_refused_before_the_kernel_reads_them(kdir):
    layer = q4_layer.Q4Linear.dense(torch.nn.Linear(256, 8), kdir)
    with pytest.raises(ValueError, match="runs on the CPU"):
        q4.linear(torch.randn(1, 256, device="meta"), layer.blocks, layer.kind_ids, layer.rows, 256, kdir)


@pytest.mark.parametrize("ceiling", q4.PATHS)
@pytest.mark.parametrize("gguf_type,k", [("Q4_K", 512), ("Q6_K", 256), ("Q5_0", 96), ("Q8_0", 288)])
def test_dequantization_in_c_is_the_reference_bit_for_bit(kdir, gguf_type, k, ceiling):
    """The C dequantizer (embeddings, dense heads, the dense route) gives gguf's float32 values, and torch's bf16
    rounding of them, on every path (a width that ends inside a superblock included)."""
    raw = random_gguf(gguf_type, 10, k, seed=3)
    kind, rows = q4.from_gguf(gguf_type, raw, k, kdir)
    ref = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[gguf_type]).reshape(10, k))
    assert torch.equal(q4.dequantize_rows(kind, rows, k, torch.float32, kdir, ceiling), ref)
    assert torch.equal(q4.dequantize_rows(kind, rows, k, torch.bfloat16, kdir, ceiling), ref.to(torch.bfloat16))
