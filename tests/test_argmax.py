"""``kernels.argmax``: the same index as ``torch.argmax`` for every input (ties, NaN, infinities, strides, batches),
numpy's for float32 host tensors and torch's for the rest."""

from __future__ import annotations

import torch

from hf_adaspec.kernels.argmax import argmax


def test_the_index_is_torchs_for_ties_nan_infinities_and_strided_batches():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 1000)
    x[0, 0, [7, 9]] = 50.0  # a tie: the first
    x[1, 2, 5] = float("nan")  # NaN counts as the largest
    x[1, 3, [3, 8]] = float("nan")
    x[2, 1] = float("-inf")  # every value equal
    x[2, 2, [1, 4]] = float("inf")
    cases = [x, x[:, 1], x[..., ::3], x.transpose(0, 1), x[:, :, :1]]
    for scores in cases:
        got = argmax(scores)
        assert got.dtype == torch.long and torch.equal(got, scores.argmax(dim=-1))


def test_other_dtypes_and_tensors_that_need_grad_take_torchs_argmax():
    torch.manual_seed(1)
    for scores in (torch.randn(2, 300).to(torch.bfloat16), torch.randn(2, 300, dtype=torch.float64)):
        assert torch.equal(argmax(scores), scores.argmax(dim=-1))
    grad = torch.randn(2, 300, requires_grad=True)
    assert torch.equal(argmax(grad), grad.argmax(dim=-1))
