"""Packed grouped-query attention (``backend.attention.packed_gqa``) computes PyTorch's SDPA with the
key/value heads repeated per query head, for one and several query rows, boolean, additive and no masks,
batch rows with different masks, in fp32 and bf16; ``use_packed_attention`` switches a model's sdpa
attention without changing its logits beyond the kernel's rounding, and leaves other implementations alone.
The C attention of a block of new rows over a cache (``kernels.layer_ops.attention``) is SDPA's within rounding,
and each row's bits are its own: the same in a block as alone, on one thread as on two."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_adaspec.backend import hf_compat
from hf_adaspec.backend.attention import packed_gqa
from hf_adaspec.backend.hf_compat import model_calls
from hf_adaspec.kernels import layer_ops


def _reference(query, key, value, mask, scale):
    g = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), attn_mask=mask, scale=scale
    )  # [B, H, n, D]
    return out.transpose(1, 2)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize(
    "n,heads,kv,mask_kind",
    [(1, 6, 2, "none"), (1, 14, 2, "bool"), (4, 6, 2, "bool"), (3, 4, 1, "additive"), (5, 4, 4, "bool")],
)
def test_packed_gqa_equals_sdpa_with_repeated_heads(dtype, tol, n, heads, kv, mask_kind):
    gen = torch.Generator().manual_seed(n * 100 + heads)
    b, length, d = 2, 37, 16
    query = torch.randn(b, heads, n, d, generator=gen).to(dtype)
    key, value = (torch.randn(b, kv, length, d, generator=gen).to(dtype) for _ in range(2))
    visible = torch.ones(b, 1, n, length, dtype=torch.bool).tril(length - n)
    visible[1, :, :, :5] = False  # the second row's first columns are holes
    mask = {
        "none": None,
        "bool": visible,
        "additive": torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, float("-inf")),
    }[mask_kind]
    got = packed_gqa(query, key, value, mask, d**-0.5)
    want = _reference(query, key, value, mask, d**-0.5)
    assert got.shape == (b, n, heads, d) and got.dtype == dtype and got.is_contiguous()
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got.float() - want.float()).abs().max()


def test_packed_gqa_refuses_uneven_heads_and_per_head_masks():
    query, key = torch.zeros(1, 6, 1, 8), torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="evenly"):
        packed_gqa(query, key, key, None, 1.0)
    with pytest.raises(ValueError, match="one head"):
        packed_gqa(
            torch.zeros(1, 4, 1, 8),
            torch.zeros(1, 2, 3, 8),
            torch.zeros(1, 2, 3, 8),
            torch.ones(1, 4, 1, 3, dtype=torch.bool),
            1.0,
        )


def _block(dtype, b=2, heads=6, kv=2, n=5, held=37, d=32, spare=3, seed=0):
    """Queries [B, H, n, D] and a cache's keys and values [B, H_kv, held + n + spare, D]."""
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(b, heads, n, d, generator=gen).to(dtype)
    keys, values = (torch.randn(b, kv, held + n + spare, d, generator=gen).to(dtype) for _ in range(2))
    return query, keys, values


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("b,heads,kv,n,held,d", [(2, 6, 2, 5, 37, 32), (1, 4, 4, 1, 9, 16), (1, 12, 2, 3, 700, 64)])
def test_c_attention_is_sdpa_within_rounding(dtype, tol, b, heads, kv, n, held, d, kernel_dir):
    """Grouped and plain heads, one and several rows, a cache longer than the block's columns, and a long one
    (the C code's threads)."""
    query, keys, values = _block(dtype, b, heads, kv, n, held, d)
    got = layer_ops.attention(query, keys, values, held, d**-0.5, kernel_dir)
    want = layer_ops.attention_reference(query, keys, values, held, d**-0.5)
    assert got.shape == (b, n, heads, d) and got.dtype == dtype and got.is_contiguous()
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (got.float() - want.float()).abs().max()
    assert not torch.equal(got, want) or dtype == torch.bfloat16  # the C path ran: fp32 bits differ somewhere


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("held", [37, 62, 700])
def test_c_attention_gives_each_row_the_bits_it_has_alone(dtype, held, kernel_dir):
    """A block's row i is the row computed alone over held + i columns, bit for bit, on one thread as on two: a
    verification's rows are the decoding steps' rows. At held 62 and 700 the rows' last columns fall on both sides
    of a boundary of the blocks in which keys and values are read (64 columns)."""
    query, keys, values = _block(dtype, held=held)
    n, scale = query.shape[2], 32**-0.5
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        block = layer_ops.attention(query, keys, values, held, scale, kernel_dir)  # [B, n, H, D]
        torch.set_num_threads(1)
        alone = [
            layer_ops.attention(query[:, :, i : i + 1].contiguous(), keys, values, held + i, scale, kernel_dir)
            for i in range(n)
        ]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(block[:, i : i + 1], row) for i, row in enumerate(alone))
    later = keys.clone()
    later[:, :, held + n :] = 7.0  # columns past the block's are not read
    assert torch.equal(layer_ops.attention(query, later, values, held, scale, kernel_dir), block)


def test_c_attention_refuses_uneven_heads_and_columns_past_the_cache_and_hands_other_dtypes_to_torch(kernel_dir):
    query, keys, values = _block(torch.float32)
    with pytest.raises(ValueError, match="key/value heads"):
        layer_ops.attention(query[:, :5].contiguous(), keys, values, 37, 1.0, kernel_dir)
    with pytest.raises(ValueError, match="columns"):
        layer_ops.attention(query, keys, values, 41, 1.0, kernel_dir)  # 41 + 5 columns of 45
    half = [t.half() for t in (query, keys, values)]
    assert torch.equal(layer_ops.attention(*half, 37, 1.0, kernel_dir), layer_ops.attention_reference(*half, 37, 1.0))
    odd = _block(torch.float32, d=24)  # not a multiple of 16: torch's
    assert torch.equal(layer_ops.attention(*odd, 37, 1.0, kernel_dir), layer_ops.attention_reference(*odd, 37, 1.0))


def test_use_packed_attention_keeps_a_models_logits(tiny_factory, monkeypatch):
    """The tiny Llama (grouped-query: 4 heads over 2) on a left-padded prompt, then 1 and 3 cached tokens: every
    forward runs packed (the padding materialises the masks), with the logits of transformers' sdpa."""
    model = tiny_factory(0)
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    valid = torch.ones(1, 12, dtype=torch.long)
    valid[0, 0] = 0  # a padding column: the masks are materialised
    rows: list[int] = []
    monkeypatch.setattr(model_calls, "packed_gqa", lambda q, *a: rows.append(q.shape[2]) or packed_gqa(q, *a))

    def logits():
        with torch.no_grad():
            cache = hf_compat.new_cache(model)
            out = [
                model(ids[:, a:b], attention_mask=valid[:, :b], past_key_values=cache, use_cache=True).logits
                for a, b in ((0, 8), (8, 9), (9, 12))
            ]
        return torch.cat(out, dim=1)

    assert model.config._attn_implementation == "sdpa"
    before = logits()
    assert hf_compat.use_packed_attention(model) and hf_compat.use_packed_attention(model)  # idempotent
    assert model.config._attn_implementation == hf_compat.PACKED_SDPA
    after = logits()
    assert set(rows) == {8, 1, 3}
    assert torch.allclose(after, before, atol=1e-5)
    model.set_attn_implementation("eager")
    assert not hf_compat.use_packed_attention(model) and model.config._attn_implementation == "eager"
