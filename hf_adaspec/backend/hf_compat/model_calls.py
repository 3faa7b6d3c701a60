"""Calling a model: one forward over a block on top of a cache (logits of the last columns, EAGLE-3's features),
and the attention implementation that packs grouped-query heads on a CPU."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..attention import packed_gqa
from .cache_layers import cache_length, windowed_layers
from .flat_forward import flat_forward
from .masks import block_masks

PACKED_SDPA = "hf_adaspec_packed_sdpa"  # the attention implementation ``use_packed_attention`` sets


def _packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except on a CPU with grouped-query heads, where the query heads are packed
    by key/value head (``attention.packed_gqa``). A causal block without a mask (a prompt), dropout, and the
    options sdpa refuses or adds (softcap, sinks, position bias) go to transformers' function."""
    unpackable = (
        query.device.type != "cpu"
        or query.shape[1] == key.shape[1]
        or dropout
        or (attention_mask is None and query.shape[2] > 1)
        or (attention_mask is not None and attention_mask.shape[1] != 1)
        or any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "position_bias"))
    )
    if unpackable:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return packed_gqa(query, key, value, attention_mask, scale), None


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch ``model`` from transformers' "sdpa" attention to ``_packed_sdpa`` (same masks, same kernel; on a
    CPU grouped-query heads are packed). Idempotent; False (nothing changed) for any other implementation."""
    if model.config._attn_implementation == PACKED_SDPA:
        return True
    if model.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(PACKED_SDPA, _packed_sdpa)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)
    model.set_attn_implementation(PACKED_SDPA)
    return True


def input_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s input embedding, where its inputs go (``model.device`` walks the parameters, and
    transformers' ``get_input_embeddings`` searches the modules: both cost a step's worth of Python to repeat)."""
    return model.get_input_embeddings().weight.device


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, cache: DynamicCache, keep: int) -> torch.Tensor:
    """Run ``model`` on new tokens appended to ``cache``; return float32 logits of the last ``keep``.

    input_ids: [B, n] long (any device) → logits [B, keep, V] float32 on the CPU. Positions follow the
    cache length. Inputs go to the model's device.
    """
    return forward(model, input_ids, cache, keep)[0].cpu()


def forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: DynamicCache,
    keep: int,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    feature_layers: tuple[int, ...] = (),
    device: torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of ``model`` over input_ids [B, n] on top of ``cache`` (with ``attention_mask`` [B, L + n]
    and ``position_ids`` [B, n] for rows with holes, else positions follow the cache length) → float32
    logits of the last ``keep`` columns [B, keep, V] on the model's device and, with ``feature_layers``, the
    residual stream at the inputs of those layers for every column, concatenated: [B, n, len(layers)·H]
    float32 on the CPU (EAGLE-3's target features; transformers' hidden_states[i] is the input of layer i).
    ``device``: the model's (``input_device``), where a caller that runs many forwards has it; else looked up.
    A q4 model of a known family under the packed attention, without holes, runs as ``flat_forward`` (the same
    values, fewer module calls)."""
    device = device or input_device(model)
    masked = {}
    if attention_mask is not None:
        masked = {
            "attention_mask": block_masks(model, attention_mask, position_ids, cache),
            "position_ids": position_ids.to(device),
        }
    elif windowed := windowed_layers(cache):  # no holes: transformers sizes the masks from the first visible columns
        held = cache_length(cache)
        for layer in windowed:
            kind, width = layer.window
            layer.visible_from = max(0, held - width + 1) if kind == "sliding" else held // width * width
    input_ids = input_ids.to(device)
    flat = None
    if not masked and model.config._attn_implementation == PACKED_SDPA:
        flat = flat_forward(model, input_ids, cache, keep, feature_layers)  # None: not a model or block it runs
    logits, features = flat or raw_forward(model, input_ids, cache, keep, feature_layers=feature_layers, **masked)
    return logits.float(), None if features is None else features.float().cpu()


def raw_forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    cache: Cache,
    keep: int,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    feature_layers: tuple[int, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model call itself, every tensor already on the model's device (what a CUDA graph captures):
    logits of the last ``keep`` columns [B, keep, V] and the concatenated features [B, n, len(layers)·H]
    (None without layers), both in the model's dtype. ``attention_mask``: 2-D [B, L + n], or prepared 4-D
    masks [B, 1, n, L] (``layer_masks``: one, or one per layer type), which transformers uses as given."""
    out = model(
        input_ids=input_ids,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=keep,
        output_hidden_states=bool(feature_layers),
        attention_mask=attention_mask,
        position_ids=position_ids,
    )
    features = torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1) if feature_layers else None
    logits = out.logits  # [B, keep, V] where the model honours logits_to_keep
    return logits if logits.shape[1] == keep else logits[:, -keep:], features
