"""The q4 kernel (``kernels/q4``): packing, the integer matmul against its exact emulation in torch, the layer,
and the errors that name a fix. Built once per session into a temporary directory (conftest's ``kernel_dir``)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from hf_adaspec.kernels import q4


@pytest.fixture
def kdir(kernel_dir):
    return kernel_dir


def _emulated(x: torch.Tensor, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """What the kernel computes, in float64 torch: activations to int8 per group of 32 (scale max|x| / 127, round
    half to even), integer dot products with the 4-bit codes, scaled, plus minimum × the group's quantized sum."""
    kp = blocks.shape[1] * q4.BLOCK
    xg = torch.nn.functional.pad(x.float(), (0, kp - k)).view(x.shape[0], -1, q4.GROUP)  # [M, G, 32]
    dx = xg.abs().amax(-1) / 127  # [M, G] float32, as in C
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))
    qx = (xg * inv[..., None]).round()  # [M, G, 32]
    w = q4.unpack(blocks, kp).view(blocks.shape[0], -1, q4.GROUP).double()  # [N, G, 32]
    xdeq = (qx * dx[..., None]).double()
    return torch.einsum("mgj,ngj->mn", xdeq, w).float()


@pytest.mark.parametrize("portable", [False, True], ids=["this-cpu", "portable"])
@pytest.mark.parametrize("n,k", [(48, 256), (40, 96), (24, 544)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
def test_matmul_equals_its_emulation(kdir, n, k, m, portable):
    torch.manual_seed(m * 1000 + k)
    w, x = torch.randn(n, k), torch.randn(m, k)
    blocks = q4.pack(w)
    y = q4.linear(x, blocks, n, kdir, portable=portable)  # [M, N]
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, _emulated(x, blocks, k), rtol=1e-4, atol=1e-4)


def test_fp16_scales_of_every_kind_convert_in_the_portable_path(kdir):
    """Subnormal, zero and negative fp16 minima and scales: the portable path's own fp16 conversion."""
    w = torch.zeros(4, 256)
    w[0] = torch.linspace(-1e-6, 1e-6, 256)  # subnormal fp16 scales
    w[1] = -3.0  # zero scale, negative minimum
    w[2] = torch.linspace(-2.0, 5.0, 256)
    blocks, x = q4.pack(w), torch.randn(3, 256)
    fast, portable = q4.linear(x, blocks, 4, kdir), q4.linear(x, blocks, 4, kdir, portable=True)
    torch.testing.assert_close(portable, fast, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(portable, _emulated(x, blocks, 256), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("portable", [False, True], ids=["this-cpu", "portable"])
def test_bfloat16_in_and_out_with_bias_is_the_float_result_rounded_once(kdir, portable):
    """bf16 activations are read in place and the bias is added before the one rounding to bf16: bit for bit what
    the float32 path plus the bias, then torch's rounding, gives."""
    torch.manual_seed(3)
    w, bias = torch.randn(40, 544), torch.randn(40)
    x = torch.randn(5, 544).to(torch.bfloat16)
    blocks = q4.pack(w)
    y = q4.linear(x, blocks, 40, kdir, bias=bias, portable=portable)  # [5, 40]
    ref = q4.linear(x.float(), blocks, 40, kdir, portable=portable) + bias
    assert y.dtype == torch.bfloat16 and y.shape == (5, 40)
    assert torch.equal(y, ref.to(torch.bfloat16))
    assert not torch.equal(y, q4.linear(x, blocks, 40, kdir, portable=portable))  # the bias was added


def test_other_dtypes_go_through_float32_and_too_wide_inputs_are_refused(kdir):
    blocks = q4.pack(torch.randn(8, 256))
    x = torch.randn(2, 200)
    half = q4.linear(x.half(), blocks, 8, kdir)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, q4.linear(x.half().float(), blocks, 8, kdir), rtol=0, atol=0)
    with pytest.raises(ValueError, match="300 input features but the packed weight holds 256"):
        q4.linear(torch.randn(1, 300), blocks, 8, kdir)


def test_a_bias_of_another_dtype_and_an_empty_input(kdir):
    torch.manual_seed(5)
    blocks, bias, x = q4.pack(torch.randn(16, 256)), torch.randn(16), torch.randn(3, 256)
    torch.testing.assert_close(q4.linear(x, blocks, 16, kdir, bias=bias.to(torch.bfloat16)),
                               q4.linear(x, blocks, 16, kdir, bias=bias.to(torch.bfloat16).float()), rtol=0, atol=0)
    assert q4.linear(x[:0], blocks, 16, kdir, bias=bias).shape == (0, 16)


def test_q4_linear_reads_strided_inputs_as_their_values(kdir):
    torch.manual_seed(4)
    layer = q4.Q4Linear(torch.nn.Linear(64, 16).to(torch.bfloat16), kdir)
    x = torch.randn(3, 128, dtype=torch.bfloat16)[:, ::2]  # [3, 64], not contiguous
    assert torch.equal(layer(x), layer(x.contiguous()))


def test_pack_rounds_each_weight_to_its_groups_nearest_level():
    torch.manual_seed(0)
    w = torch.randn(16, 320)
    back = q4.unpack(q4.pack(w), 320)
    step = (w.view(16, 10, 32).amax(-1) - w.view(16, 10, 32).amin(-1)) / 15  # [16, 10]
    err = (back - w).abs().view(16, 10, 32)
    assert back.shape == w.shape
    assert bool((err <= step[..., None] * 0.5 + 2e-3 * w.abs().max()).all())  # half a level, fp16 scales aside
    assert float(err.mean()) > 0  # 4 bits: not lossless


def test_pack_refuses_widths_that_are_not_whole_groups():
    with pytest.raises(ValueError, match="multiple of 32"):
        q4.pack(torch.randn(4, 40))


def test_q4_linear_keeps_shape_dtype_and_bias_and_approximates_the_dense_layer(kdir):
    torch.manual_seed(1)
    dense = torch.nn.Linear(96, 40).to(torch.bfloat16)
    layer = q4.Q4Linear(dense, kdir)
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)
    y = layer(x)
    assert y.shape == (2, 3, 40) and y.dtype == torch.bfloat16
    ref = dense(x).float()
    assert float((y.float() - ref.detach()).norm() / ref.detach().norm()) < 0.1
    nobias = q4.Q4Linear(torch.nn.Linear(96, 40, bias=False), kdir)
    assert nobias.bias is None and "bias=False" in repr(nobias)


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
    blocks = q4.pack(torch.randn(8, 256))
    with pytest.raises(ValueError, match="runs on the CPU"):
        q4.linear(torch.randn(1, 256, device="meta"), blocks, 8, kdir)
