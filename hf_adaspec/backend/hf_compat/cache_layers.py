"""KV cache layers: ``GrowingLayer`` (a dynamic cache whose buffers double, keeping every column of windowed
layers so rejected drafts roll back past the window) and ``_ColumnLayer`` (a preallocated arena written at given
columns), and the operations the engine applies to caches (length, rollback, copies, row selection); an empty
cache that ``generate`` made is given growing layers (``grow_empty_cache``)."""

from __future__ import annotations

import copy

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from .model_facts import ATTENTION_TYPES, kv_shape, layer_types, layer_windows


class GrowingLayer(DynamicLayer):
    """One attention layer's keys and values [B, H_kv, L, D] (``keys``/``values``): views of buffers whose column
    capacity doubles when full, so appending n columns copies n columns (transformers' ``DynamicLayer``
    concatenates, copying all L every step). Every column is kept, in sliding-window and chunked layers too
    (transformers' ``DynamicSlidingWindowLayer`` keeps only the last window and cannot roll rejected tokens back
    past it); ``window`` (("sliding", w) or ("chunked", c); None: full attention): a forward's queries see
    the columns from ``visible_from`` on (set before each forward by ``forward``; masks are sized from it)."""

    def __init__(self, window: tuple[str, int] | None = None) -> None:
        super().__init__()
        self.window, self.is_sliding, self.visible_from, self.length = window, window is not None, 0, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        self._k, self._v = key_states[:, :, :0].clone(), value_states[:, :, :0].clone()
        self._view()

    def _view(self) -> None:
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[2]
        self._fit(end)
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._view()
        if not self.visible_from:
            return self.keys, self.values
        return self._k[:, :, self.visible_from : end], self._v[:, :, self.visible_from : end]

    def _fit(self, end: int) -> None:
        """Room for ``end`` columns: the capacity doubled (at least 64 columns) where it is less."""
        if end > self._k.shape[2]:
            wider = max(end, 2 * self._k.shape[2], 64)
            pad = (0, 0, 0, wider - self._k.shape[2])
            self._k, self._v = (torch.nn.functional.pad(t, pad) for t in (self._k, self._v))

    def open_columns(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """n new columns for a caller that writes their keys and values itself (``update`` without the copies):
        (the keys' and the values' buffers [B, H_kv, C, D], contiguous, grown to hold them, and the first new
        column). The layer holds them from now on (``keys``/``values`` include them); the caller writes columns
        first … first + n − 1 of both before anything reads them. Raises ValueError before the first ``update``
        (the buffers' shape and dtype come from it) and on a layer with a window."""
        if not self.is_initialized or self.window is not None:
            raise ValueError("open_columns takes a layer without a window, after its first update")
        first = self.length
        self._fit(first + n)
        self.length = first + n
        self._view()
        return self._k, self._v, first

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length - self.visible_from, self.visible_from

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of columns to remove, got {tokens_to_remove}")
        self.length = max(0, self.length + tokens_to_remove)
        if self.is_initialized:
            self._view()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self._view()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Rows taken in ``beam_idx``'s order (beam search), as transformers' layers take them."""
        if self.is_initialized:
            self._k, self._v = (t.index_select(0, beam_idx.to(t.device)) for t in (self._k, self._v))
            self._view()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._k, self._v = (t.repeat_interleave(repeats, dim=0) for t in (self._k, self._v))
            self._view()

    def reset(self) -> None:
        self.length, self.visible_from = 0, 0
        if self.is_initialized:
            self._view()


def new_cache(model: torch.nn.Module) -> DynamicCache:
    """An empty KV cache for ``model`` whose attention layers are ``GrowingLayer``s (sliding-window and chunked
    layers keep every column: their windows are applied by the attention masks, by transformers from the
    columns where a row has no holes, by ``layer_masks`` from token positions where it has); other layer types
    (layers without keys and values) as transformers makes them."""
    cache = DynamicCache(config=model.config)
    windows = layer_windows(model)
    cache.layers = [
        GrowingLayer(windows[kind]) if kind in ATTENTION_TYPES else layer
        for layer, kind in zip(cache.layers, layer_types(model), strict=True)
    ]
    return cache


def grow_empty_cache(model: torch.nn.Module, cache: Cache) -> bool:
    """Give an empty transformers ``DynamicCache`` of a model with full attention only (its layers
    ``DynamicLayer``s not yet written, as ``generate`` makes it) ``new_cache``'s ``GrowingLayer``s, in place: its
    keys and values are then appended without copying the cache, and the flat forward's decoder stack writes into
    them. True where it did; a cache of any other kind, or one holding columns, is left as it is."""
    if type(cache) is not DynamicCache or any(
        type(layer) is not DynamicLayer or layer.is_initialized for layer in cache.layers
    ):
        return False
    if len(cache.layers) != len(layer_types(model)) or any(
        window is not None for window in layer_windows(model).values()
    ):
        return False
    cache.layers = new_cache(model).layers
    return True


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

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
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


def dynamic_cache_of(model: torch.nn.Module, keys: list[torch.Tensor], values: list[torch.Tensor]) -> DynamicCache:
    """A ``new_cache`` of ``model`` holding copies of per-layer ``keys``/``values`` [B, H_kv, n, D] (a prefix to
    keep)."""
    cache = new_cache(model)
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        cache.update(k.detach().clone(), v.detach().clone(), layer)
    return cache


def cache_tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the (keys, values) [B, H_kv, n, D] a ``DynamicCache`` holds."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep only batch rows ``rows`` ([b] long indices) of ``cache``, in that order."""
    cache.batch_select_indices(rows)


def windowed_layers(cache: Cache) -> list[GrowingLayer]:
    """The sliding-window and chunked layers of a cache ``new_cache`` made (none in another cache)."""
    return [layer for layer in cache.layers if isinstance(layer, GrowingLayer) and layer.window is not None]
