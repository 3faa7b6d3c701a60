"""Packed grouped-query attention (``backend.attention.packed_gqa``) computes PyTorch's SDPA with the
key/value heads repeated per query head, for one and several query rows, boolean, additive and no masks,
batch rows with different masks, in fp32 and bf16; ``use_packed_attention`` switches a model's sdpa
attention without changing its logits beyond the kernel's rounding, and leaves other implementations alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_adaspec.backend import hf_compat
from hf_adaspec.backend.attention import packed_gqa
from hf_adaspec.backend.hf_compat import model_calls


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
