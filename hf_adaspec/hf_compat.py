"""Every touch of transformers internals lives here: caches, raw forwards, vocabulary size.

Tested against transformers 5.x (see pyproject's pin). The engine calls only these functions, so a
transformers upgrade that moves an internal breaks one module.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty KV cache for ``model``."""
    return DynamicCache(config=model.config)


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held by the cache (tokens)."""
    return cache.get_seq_length()


def rollback(cache: DynamicCache, length: int) -> None:
    """Drop every cached position at or past ``length`` (keep the first ``length`` tokens)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)  # transformers 5.x: a negative argument removes that many positions


def forward_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, cache: DynamicCache, keep: int
) -> torch.Tensor:
    """Run ``model`` on new tokens appended to ``cache``; return float32 logits of the last ``keep``.

    input_ids: [B, n] long → logits [B, keep, V] float32. Positions follow the cache length.
    """
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=keep)
    return out.logits[:, -keep:].float()


def forward_logits_masked(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    keep: int,
) -> torch.Tensor:
    """``forward_logits`` for rows with holes: ``attention_mask`` [B, L + n] covers cached and new
    positions (0 = padding or a rejected draft position), ``position_ids`` [B, n] the RoPE positions.

    input_ids: [B, n] long → logits [B, keep, V] float32.
    """
    out = model(input_ids=input_ids, past_key_values=cache, attention_mask=attention_mask,
                position_ids=position_ids, use_cache=True, logits_to_keep=keep)
    return out.logits[:, -keep:].float()


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only batch rows ``rows`` ([b] long indices) of ``cache``, in that order."""
    cache.batch_select_indices(rows)


def vocab_size(model: torch.nn.Module) -> int:
    """Width of the logits' last dim: the output head's ``out_features`` (also for quantized heads)."""
    return model.get_output_embeddings().out_features


def eos_token_ids(generation_config) -> tuple[int, ...]:
    """EOS ids as prepared by ``generate`` (the config's private tensor, set before our callable runs)."""
    eos = getattr(generation_config, "_eos_token_tensor", None)
    return tuple(int(t) for t in eos.flatten()) if eos is not None else ()


def pad_token_id(generation_config) -> int:
    """Pad id as prepared by ``generate`` (it falls back to EOS); 0 when neither is set."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is not None:
        return int(pad.flatten()[0])
    eos = eos_token_ids(generation_config)
    return generation_config.pad_token_id if generation_config.pad_token_id is not None else (eos[0] if eos else 0)
