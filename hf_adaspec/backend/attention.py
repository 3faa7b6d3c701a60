"""Grouped-query attention with each key/value head's query heads packed into one block of rows.

On a CPU, transformers' sdpa path runs a grouped-query model's few-token forwards slowly: it either asks
PyTorch's SDPA for grouped-query attention (``enable_gqa``) or copies the keys and values once per query
head (``repeat_kv``), and the CPU flash kernel then works per head and per block of query rows. Decoding
and verification have 1 … k+1 query rows over a long cache, so that per-head work dominates.

Packing instead reads the G query heads that share a key/value head as G·n query rows of that head, so the
cache is read once per key/value head and nothing is copied. transformers' ``pack_gqa`` does this for one
token; FlashAttention-2 does it for any number of rows. The mask row of position i serves each of the G
heads' rows for i. Each output row is the same SDPA computation over the same keys, values and mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def packed_gqa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Scaled dot-product attention, softmax(q·kᵀ·scale + mask)·v (Vaswani et al. 2017, eq. 1, with
    ``scale`` for 1/√D), with query heads packed by key/value head.

    query [B, H, n, D]; key and value [B, H_kv, L, D] with H a multiple of H_kv (query head h reads key/value
    head h // (H / H_kv)); mask [B or 1, 1, n, L], boolean (True = attend) or additive, or None (every column
    visible to every row) → [B, n, H, D] in the query's dtype.

    Raises:
        ValueError: H not a multiple of H_kv, or a mask with more than one head.
    """
    b, h, n, d = query.shape
    kv = key.shape[1]
    if h % kv:
        raise ValueError(f"{h} query heads cannot share {kv} key/value heads evenly")
    g = h // kv
    rows = query.reshape(b, kv, g * n, d)  # row j·n + i: position i of query head kv·g + j
    if mask is not None:
        if mask.shape[1] != 1:
            raise ValueError(f"the mask must have one head (shape [B, 1, n, L]), got {tuple(mask.shape)}")
        mask = mask.expand(b, 1, n, mask.shape[-1])
        mask = mask.expand(b, 1, g, mask.shape[-1]) if n == 1 else mask.repeat(1, 1, g, 1)  # [B, 1, g·n, L]
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scale)  # [B, H_kv, g·n, D]
    return out.view(b, h, n, d).transpose(1, 2).contiguous()
