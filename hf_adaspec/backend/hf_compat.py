"""Every touch of transformers internals lives here: caches, raw forwards, the attention implementation
(``use_packed_attention``), vocabulary size, and the keywords ``generate``'s custom_generate path drops (stop
strings' tokenizer, assisted-generation options).

Tested against transformers 5.x (see pyproject's pin). The engine calls only these functions, so a
transformers upgrade that moves an internal breaks one module.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from transformers import AttentionInterface, DynamicCache, StoppingCriteriaList, StopStringCriteria
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer, DynamicSlidingWindowLayer, \
    get_layer_types_and_kwargs
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .attention import packed_gqa

# transformers' own assisted generation: GenerationConfig fields, also generate keywords (with the
# generate-only ``assistant_tokenizer``, see ``assisted_generation_options``); the custom_generate path ignores them
ASSISTED_GENERATION_OPTIONS = (
    "prompt_lookup_num_tokens", "max_matching_ngram_size", "num_assistant_tokens", "num_assistant_tokens_schedule",
    "assistant_confidence_threshold", "assistant_early_exit", "assistant_lookbehind", "target_lookbehind", "use_mtp",
)


PACKED_SDPA = "hf_adaspec_packed_sdpa"  # the attention implementation ``use_packed_attention`` sets


def _packed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except on a CPU with grouped-query heads, where the query heads are packed
    by key/value head (``attention.packed_gqa``). A causal block without a mask (a prompt), dropout, and the
    options sdpa refuses or adds (softcap, sinks, position bias) go to transformers' function."""
    unpackable = (query.device.type != "cpu" or query.shape[1] == key.shape[1] or dropout
                  or (attention_mask is None and query.shape[2] > 1)
                  or (attention_mask is not None and attention_mask.shape[1] != 1)
                  or any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "position_bias")))
    if unpackable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
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


ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # layer types speculation serves
_NO_KV = "dummy"  # transformers' type for layers that keep no keys and values (MoE/MLP-only, KV-sharing consumers)


def layer_types(model: torch.nn.Module) -> tuple[str, ...]:
    """The layer type of each decoder layer, as transformers' caches read them from the text config
    ("full_attention", "sliding_attention", "chunked_attention", "linear_attention", "conv", "dummy", …)."""
    return tuple(get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0])


def speculation_reason(model: torch.nn.Module) -> str | None:
    """Why speculation cannot run on ``model``, or None: layers whose state is recurrent or compressed (linear
    attention, convolutions, state-space layers such as Mamba or gated DeltaNet: transformers' "stateful"
    models) cannot drop rejected tokens, which a KV cache does by cropping columns."""
    other = sorted(set(layer_types(model)) - {*ATTENTION_TYPES, _NO_KV})
    if other or model._is_stateful:
        layers = f"{', '.join(other)} layers" if other else "layers with a recurrent state"
        return (f"{type(model).__name__} has {layers}, which cannot roll back rejected draft tokens; "
                "speculation needs attention layers that keep keys and values (full, sliding-window or chunked)")
    return None


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty KV cache for ``model`` in which every attention layer keeps all its columns: sliding-window
    and chunked layers too (transformers' ``DynamicSlidingWindowLayer`` keeps only the last window and
    cannot roll rejected tokens back past it). Their windows are applied by the attention masks: by
    transformers from the columns where a row has no holes, by ``layer_masks`` from token positions where
    it has."""
    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


def synthetic_cache(model: torch.nn.Module, batch: int, length: int, seed: int = 0) -> DynamicCache:
    """A cache holding ``length`` positions of random keys and values for ``batch`` rows, as if a
    prompt had been prefilled (attention's cost does not depend on the values; prefilling 16×4096
    tokens would take minutes on a CPU).

    Per layer keys and values are [batch, kv_heads, length, head_dim] in the embedding's dtype, read
    from the text config (``num_key_value_heads``, ``head_dim`` or hidden_size / heads). Raises
    ValueError for batch or length < 1.
    """
    if batch < 1 or length < 1:
        raise ValueError(f"a synthetic cache needs batch >= 1 and length >= 1, got {batch}, {length}")
    layers, kv_heads, head_dim, dtype = kv_shape(model)
    device = model.get_input_embeddings().weight.device
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(batch, kv_heads, length, head_dim, generator=gen).to(device=device, dtype=dtype)
    cache = new_cache(model)
    for layer in range(layers):
        cache.update(states, states, layer)  # each layer concatenates into tensors of its own
    return cache


def cache_length(cache: DynamicCache) -> int:
    """Number of positions held by the cache (tokens)."""
    return cache.get_seq_length()


def rollback(cache: DynamicCache, length: int) -> None:
    """Drop every cached position at or past ``length`` (keep the first ``length`` tokens)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)  # transformers 5.x: a negative argument removes that many positions


def copy_cache(cache: DynamicCache, length: int) -> DynamicCache:
    """An independent copy of ``cache`` holding only its first ``length`` positions (tokens)."""
    if not 0 <= length <= cache.get_seq_length():
        raise ValueError(f"length must be in [0, {cache.get_seq_length()}], got {length}")
    out = copy.deepcopy(cache)
    rollback(out, length)
    return out


def forward_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, cache: DynamicCache, keep: int
) -> torch.Tensor:
    """Run ``model`` on new tokens appended to ``cache``; return float32 logits of the last ``keep``.

    input_ids: [B, n] long (any device) → logits [B, keep, V] float32 on the CPU. Positions follow the
    cache length. Inputs go to the model's device.
    """
    return forward(model, input_ids, cache, keep)[0].cpu()


def forward(model: torch.nn.Module, input_ids: torch.Tensor, cache: DynamicCache, keep: int,
            attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
            feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of ``model`` over input_ids [B, n] on top of ``cache`` (with ``attention_mask`` [B, L + n]
    and ``position_ids`` [B, n] for rows with holes, else positions follow the cache length) → float32
    logits of the last ``keep`` columns [B, keep, V] on the model's device and, with ``feature_layers``, the
    residual stream at the inputs of those layers for every column, concatenated: [B, n, len(layers)·H]
    float32 on the CPU (EAGLE-3's target features; transformers' hidden_states[i] is the input of layer i)."""
    device = model.device
    masked = {}
    if attention_mask is not None:
        windowed = any(window is not None for window in _windows(model).values())
        masked = {"position_ids": position_ids.to(device),  # windows count tokens, not columns:
                  "attention_mask": _block_masks(model, attention_mask, position_ids) if windowed
                  else attention_mask.to(device)}
    logits, features = raw_forward(model, input_ids.to(device), cache, keep, feature_layers=feature_layers, **masked)
    return logits.float(), None if features is None else features.float().cpu()


def raw_forward(model: torch.nn.Module, input_ids: torch.Tensor, cache: Cache, keep: int,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                feature_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model call itself, every tensor already on the model's device (what a CUDA graph captures):
    logits of the last ``keep`` columns [B, keep, V] and the concatenated features [B, n, len(layers)·H]
    (None without layers), both in the model's dtype. ``attention_mask``: 2-D [B, L + n], or prepared 4-D
    masks [B, 1, n, L] (``layer_masks``: one, or one per layer type), which transformers uses as given."""
    out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=keep,
                output_hidden_states=bool(feature_layers), attention_mask=attention_mask, position_ids=position_ids)
    features = torch.cat([out.hidden_states[i] for i in feature_layers], dim=-1) if feature_layers else None
    return out.logits[:, -keep:], features


class _ColumnLayer(CacheLayerMixin):
    """One layer of a preallocated cache: keys and values [B, H_kv, L, D] at fixed addresses; ``update``
    writes a block's keys and values at the columns ``columns`` [n] (a tensor its owner fills before each
    forward) and returns the whole arena, every column masked by the caller's 4-D mask."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, columns: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.columns = keys, values, columns
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the arena exists before the first forward."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.index_copy_(2, self.columns, key_states.to(self.dtype))
        self.values.index_copy_(2, self.columns, value_states.to(self.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return self.keys.shape[2]

    def get_max_length(self) -> int:
        return self.keys.shape[2]


def column_cache(keys: list[torch.Tensor], values: list[torch.Tensor], columns: torch.Tensor) -> Cache:
    """A transformers cache over preallocated per-layer ``keys``/``values`` [B, H_kv, L, D] that writes each
    forward's block at ``columns`` [n] long (on their device). Forwards through it need ``position_ids`` and a
    4-D mask (``raw_forward``): the cache keeps no lengths."""
    return Cache(layers=[_ColumnLayer(k, v, columns) for k, v in zip(keys, values, strict=True)])


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int, torch.dtype]:
    """(layers, key/value heads, head dim, dtype) of ``model``'s KV cache, from its text config; the dtype is
    the input embedding's (what a quantized model computes in)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim, model.get_input_embeddings().weight.dtype


def static_kv_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run on a preallocated cache (layers other than attention layers that keep their
    keys and values: recurrent, or sharing another layer's cache), or None."""
    types = set(layer_types(model))
    if not types <= set(ATTENTION_TYPES):
        return f"its layers are {sorted(types)}; a preallocated cache serves {', '.join(ATTENTION_TYPES)} layers"
    return None


_WINDOWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → ``_windows`` (read per forward)


def _windows(model: torch.nn.Module) -> dict[str, tuple[str, int] | None]:
    """Each attention layer type of ``model`` → how its window narrows a causal mask: ("sliding", w): a query
    sees the keys less than w positions before it; ("chunked", c): the keys of its own chunk of c positions;
    None: every key (full attention)."""
    if model not in _WINDOWS:
        types, kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
        out: dict[str, tuple[str, int] | None] = {}
        for kind, extra in zip(types, kwargs, strict=True):
            if kind in ATTENTION_TYPES:
                out[kind] = None if kind == "full_attention" else (kind.split("_")[0], int(extra["sliding_window"]))
        _WINDOWS[model] = out
    return _WINDOWS[model]


def layer_masks(model: torch.nn.Module, visible: torch.Tensor, query_positions: torch.Tensor,
                key_positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """4-D attention masks for a block of n queries over L columns, in the form ``model``'s attention
    implementation reads (boolean for sdpa, additive float for eager, …), narrowed per layer type by its
    window counted in token positions (so holes in a row do not shorten it).

    visible: [B, 1, n, L] bool, the full-attention pattern (True = attend); query_positions [B, n] and
    key_positions [B, L] long: each query's and column's token position in its row. Returns one mask where
    ``model`` has one attention layer type, else a dict by layer type (what transformers' hybrid models take).
    Raises ValueError for an attention implementation without 4-D masks (flash attention)."""
    impl = model.config._attn_implementation
    if impl not in ALL_MASK_ATTENTION_FUNCTIONS or impl.startswith("flash"):
        raise ValueError(f"attention implementation {impl!r} takes no 4-D masks, which rows with holes and "
                         "windowed layers need; load the model with attn_implementation='sdpa'")
    distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # [B, 1, n, L]
    out = {}
    for kind, window in _windows(model).items():
        allowed = visible
        if window is not None and window[0] == "sliding":
            allowed = visible & (distance < window[1])
        elif window is not None:
            same = query_positions[:, None, :, None] // window[1] == key_positions[:, None, None, :] // window[1]
            allowed = visible & same
        out[kind] = allowed if ALL_MASK_ATTENTION_FUNCTIONS[impl] is sdpa_mask else ALL_MASK_ATTENTION_FUNCTIONS[impl](
            batch_size=allowed.shape[0], q_length=allowed.shape[2], kv_length=allowed.shape[3],
            mask_function=lambda b, h, q, kv, a=allowed: a[b, 0, q, kv], attention_mask=None,
            allow_is_causal_skip=False, dtype=model.dtype, config=model.config, device=allowed.device)
    return next(iter(out.values())) if len(out) == 1 else out  # sdpa's form is the boolean mask itself


def _block_masks(model: torch.nn.Module, mask: torch.Tensor, positions: torch.Tensor
                 ) -> torch.Tensor | dict[str, torch.Tensor]:
    """``layer_masks`` for a block of n tokens appended to a row mask: mask [B, L + n] long (1 = a token of the
    row, the block's own columns last), positions [B, n]. A column is visible to a query when it is a token of
    the row at or before it; a padding query sees itself (no row of the mask is empty)."""
    width, n = mask.shape[1], positions.shape[1]
    column = torch.arange(width)
    query_column = column[width - n :]  # [n]
    seen = column[None, :] <= query_column[:, None]  # [n, L + n]
    own = column[None, :] == query_column[:, None]
    visible = (mask.bool()[:, None, None, :] & seen[None, None]) | own[None, None]  # [B, 1, n, L + n]
    key_positions = (mask.cumsum(dim=1) - 1).clamp_min(0)  # [B, L + n]
    return layer_masks(model, visible.to(model.device), positions.to(model.device), key_positions.to(model.device))


def dynamic_cache_of(keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    """A ``DynamicCache`` holding copies of per-layer ``keys``/``values`` [B, H_kv, n, D] (a prefix to keep)."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k.detach().clone(), v.detach().clone(), layer)
    return cache


def cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the (keys, values) [B, H_kv, n, D] a ``DynamicCache`` holds."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only batch rows ``rows`` ([b] long indices) of ``cache``, in that order."""
    cache.batch_select_indices(rows)


_PLAIN_WEIGHTS = {"Parameter", "Tensor", "Params4bit", "Int8Params"}  # dense, or bitsandbytes (named by its config)


def model_identity(model: torch.nn.Module) -> dict:
    """What a model's costs depend on, read from its config: name (``_name_or_path``), parameter count, dtype,
    quantization method (``quantization_config.quant_method``, "None" when dense) and device; where weights
    were converted after loading (``models.formats``: tensor subclasses, this package's layers),
    "weights": their types."""
    config = model.config
    quant = getattr(config, "quantization_config", None)
    quant_method = getattr(quant, "quant_method", None) if quant is not None else None
    if isinstance(quant, dict):
        quant_method = quant.get("quant_method")
    return {
        "name": str(getattr(config, "_name_or_path", type(model).__name__)),
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.dtype),
        "quantization": str(quant_method),
        "device": str(model.device),
        **({"weights": converted} if (converted := _converted(model)) else {}),
    }


def _converted(model: torch.nn.Module) -> list[str]:
    """Types of a model's converted weights: parameter tensor subclasses and layers defined in this package."""
    tensors = {type(p).__name__ for p in model.parameters()} - _PLAIN_WEIGHTS
    layers = {type(m).__name__ for m in model.modules() if type(m).__module__.startswith("hf_adaspec.")}
    return sorted(tensors | layers)


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


def assisted_generation_options(kwargs: dict[str, Any]) -> tuple[str, ...]:
    """Names of transformers' assisted-generation options a ``generate`` call sets (not None or False):
    as keywords (``assistant_tokenizer`` included), or on its ``generation_config``. The model's own
    generation config is not read (the caller did not ask for what it holds; transformers fills defaults
    such as num_assistant_tokens=20 there)."""
    config = kwargs.get("generation_config")
    names = [n for n in (*ASSISTED_GENERATION_OPTIONS, "assistant_tokenizer") if _is_set(kwargs.get(n))]
    if config is not None:
        names += [n for n in ASSISTED_GENERATION_OPTIONS if n not in names and _is_set(getattr(config, n, None))]
    return tuple(names)


def _is_set(value: Any) -> bool:
    """Whether an option's value asks for something (None and False are transformers' "unset")."""
    return value is not None and value is not False


def stop_strings_as_criteria(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``generate`` keywords with the call's stop strings moved into ``stopping_criteria``.

    transformers 5.x drops ``tokenizer`` on the ``custom_generate`` path (``_extract_generation_mode_kwargs``
    pops it, then keeps only the callable's own keywords), so ``_get_stopping_criteria`` finds stop strings
    but no tokenizer and raises. With a tokenizer, this builds the ``StopStringCriteria`` plain generate would
    (from the stop strings generate would use: keyword > ``generation_config`` > ``model.generation_config``;
    a caller's own ``StopStringCriteria`` in ``stopping_criteria`` takes precedence, as in generate) and clears
    the stop strings, so generate builds none. The caller's generation config is copied, never changed.
    Without stop strings or a tokenizer the keywords come back unchanged (generate raises its own error
    naming ``tokenizer``).
    """
    tokenizer, strings = kwargs.get("tokenizer"), _stop_strings(model, kwargs)
    if tokenizer is None or strings is None:
        return kwargs
    out, given = dict(kwargs), kwargs.get("generation_config")
    if given is not None and given.stop_strings is not None:
        out["generation_config"] = copy.deepcopy(given)
        out["generation_config"].stop_strings = None
    if "stop_strings" in kwargs or model.generation_config.stop_strings is not None:
        out["stop_strings"] = None  # a keyword overrides both configs
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or ())
    if not any(type(c) is StopStringCriteria for c in criteria):
        criteria.append(StopStringCriteria(tokenizer, strings))
    out["stopping_criteria"] = criteria
    return out


def _stop_strings(model: torch.nn.Module, kwargs: dict[str, Any]) -> str | list[str] | None:
    """The stop strings generate would use, by its priority: keyword, then given config, then the model's."""
    if "stop_strings" in kwargs:
        return kwargs["stop_strings"]
    given = kwargs.get("generation_config")
    if given is not None and given.stop_strings is not None:
        return given.stop_strings
    return model.generation_config.stop_strings


def readout(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM's readout as float32 on its device: the dense output head's weight [V, H] and the final
    RMSNorm's weight [H] (a draft head is initialised from them). Raises ValueError when the output head
    is quantized (load the target with a dense head: bitsandbytes keeps it dense by default)."""
    weight = model.get_output_embeddings().weight
    if weight.dim() != 2 or weight.shape[1] != model.config.get_text_config().hidden_size:
        raise ValueError(f"the output head's weight is {tuple(weight.shape)}: a quantized head; load the target "
                         "with a dense output head")
    return weight.detach().float(), model.get_decoder().norm.weight.detach().float()
