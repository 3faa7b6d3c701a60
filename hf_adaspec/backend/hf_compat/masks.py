"""4-D attention masks for blocks appended to rows with holes (left padding, finished rows): the causal pattern
over a row's own tokens, narrowed per attention layer type by its window counted in token positions, in the form
the model's attention implementation reads."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .cache_layers import windowed_layers
from .model_facts import layer_windows


def _allowed(
    model: torch.nn.Module, visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Per attention layer type, ``visible`` [B, 1, n, L] (bool, the full-attention pattern) narrowed by the
    type's window counted in token positions (query_positions [B, n], key_positions [B, L])."""
    out = {}
    for kind, window in layer_windows(model).items():
        if window is None:
            out[kind] = visible
        elif window[0] == "sliding":
            out[kind] = visible & (query_positions[:, None, :, None] - key_positions[:, None, None, :] < window[1])
        else:
            chunk = window[1]
            out[kind] = visible & (
                query_positions[:, None, :, None] // chunk == key_positions[:, None, None, :] // chunk
            )
    return out


def _implementation_form(model: torch.nn.Module, allowed: torch.Tensor) -> torch.Tensor:
    """``allowed`` [B, 1, n, L] bool as ``model``'s attention implementation reads a 4-D mask (sdpa: the boolean
    mask itself; eager: additive float, …). Raises ValueError for one without 4-D masks (flash attention)."""
    impl = model.config._attn_implementation
    if impl not in ALL_MASK_ATTENTION_FUNCTIONS or impl.startswith("flash"):
        raise ValueError(
            f"attention implementation {impl!r} takes no 4-D masks, which rows with holes and "
            "windowed layers need; load the model with attn_implementation='sdpa'"
        )
    if ALL_MASK_ATTENTION_FUNCTIONS[impl] is sdpa_mask:
        return allowed
    return ALL_MASK_ATTENTION_FUNCTIONS[impl](
        batch_size=allowed.shape[0],
        q_length=allowed.shape[2],
        kv_length=allowed.shape[3],
        mask_function=lambda b, h, q, kv: allowed[b, 0, q, kv],
        attention_mask=None,
        allow_is_causal_skip=False,
        dtype=model.dtype,
        config=model.config,
        device=allowed.device,
    )


def _one_or_by_type(masks: dict[str, torch.Tensor]) -> torch.Tensor | dict[str, torch.Tensor]:
    """One mask where a model has one attention layer type, else the dict by type transformers' hybrid models take."""
    return next(iter(masks.values())) if len(masks) == 1 else masks


def layer_masks(
    model: torch.nn.Module, visible: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor]:
    """4-D attention masks for a block of n queries over L columns, in the form ``model``'s attention
    implementation reads, narrowed per layer type by its window counted in token positions (so holes in a
    row do not shorten it).

    visible: [B, 1, n, L] bool, the full-attention pattern (True = attend); query_positions [B, n] and
    key_positions [B, L] long: each query's and column's token position in its row. Returns one mask where
    ``model`` has one attention layer type, else a dict by layer type. Raises ValueError for an attention
    implementation without 4-D masks (flash attention)."""
    allowed = _allowed(model, visible, query_positions, key_positions)
    return _one_or_by_type({kind: _implementation_form(model, a) for kind, a in allowed.items()})


def block_masks(
    model: torch.nn.Module, mask: torch.Tensor, positions: torch.Tensor, cache: Cache
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4-D masks of a block of n tokens appended to rows with holes: mask [B, L + n] long (1 = a token of the
    row, the block's own columns last), positions [B, n]. A column is visible to a query when it is a token of
    the row at or before it; a padding query sees itself (no row of the mask is empty). Windowed layers of
    ``cache`` attend from the first column any query of theirs sees (``visible_from``), their masks cut alike."""
    width, n = mask.shape[1], positions.shape[1]
    column = torch.arange(width)
    query_column = column[width - n :]  # [n]
    seen = column[None, :] <= query_column[:, None]  # [n, L + n]
    own = column[None, :] == query_column[:, None]
    visible = (mask.bool()[:, None, None, :] & seen[None, None]) | own[None, None]  # [B, 1, n, L + n]
    allowed = _allowed(model, visible, positions, (mask.cumsum(dim=1) - 1).clamp_min(0))
    layers = windowed_layers(cache)
    if layers:
        starts = {kind: int(a.any(dim=2)[:, 0].any(dim=0).nonzero()[0]) for kind, a in allowed.items()}
        for layer in layers:
            layer.visible_from = starts[f"{layer.window[0]}_attention"]
        allowed = {kind: a[..., starts[kind] :] if layer_windows(model)[kind] else a for kind, a in allowed.items()}
    return _one_or_by_type({kind: _implementation_form(model, a.to(model.device)) for kind, a in allowed.items()})
