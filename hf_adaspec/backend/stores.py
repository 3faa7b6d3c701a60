"""Where a ``RaggedCache``'s keys and values live: a transformers ``DynamicCache`` that grows and crops (the
CPU's path), or a preallocated arena whose narrow forwards are recorded graphs (``static_kv``; a GPU's path).

Both take the same calls from ``RaggedCache``, which keeps the hole mask [b, L] and the positions on the CPU:
a forward of a block [b, n] over the columns already held, cropping to a width, keeping rows, making room
for n more columns (the arena may compact or move; the mask it returns says where each row's tokens are
now), exporting a single row's prefix for the draft prefix store, and filling a synthetic context for a
cost probe. Logits come back as float32 on the model's device; features as float32 on the CPU.
"""

from __future__ import annotations

from typing import Protocol

import torch

from . import hf_compat
from .arena_sizes import capacity_for
from .arenas import arenas_of


class KVStore(Protocol):
    """What ``RaggedCache`` asks of the keys and values underneath it (``held``: columns in use;
    ``dense_forward``: whether a forward without holes may pass no mask and no positions)."""

    held: int
    dense_forward: bool

    def forward(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        keep: int,
        layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Block tokens [b, n] (mask [b, L + n] long over held and new columns, RoPE positions [b, n]; both None:
        no holes, positions follow the columns — only where ``dense_forward``) → logits [b, keep, V] float32 on
        the model's device, features [b, n, F] float32 on the CPU or None."""
        ...

    def crop(self, width: int) -> None:
        """Hold only the first ``width`` columns."""
        ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` ([b] long indices)."""
        ...

    def make_room(self, mask: torch.Tensor, n: int) -> torch.Tensor:
        """Room for n more columns after the held ones; → the mask [b, L'] of where the tokens are now."""
        ...

    def export(self, length: int) -> object | None:
        """A transformers cache of the single row's first ``length`` columns, for the draft prefix store
        (which keeps it; the store is not used after)."""
        ...

    def fill_random(self, batch: int, context: int) -> None:
        """Hold ``context`` columns of random keys and values in each of ``batch`` rows (a probe's context)."""
        ...


class DynamicStore:
    """A transformers ``DynamicCache`` (``cache``: one that already holds the same number of tokens in every
    row, a reused prompt prefix; None: an empty one)."""

    def __init__(self, model: torch.nn.Module, cache: object | None = None) -> None:
        self.model, self.device = model, hf_compat.input_device(model)
        self.cache = cache if cache is not None else hf_compat.new_cache(model)

    @property
    def held(self) -> int:
        """Columns held."""
        return hf_compat.cache_length(self.cache)

    dense_forward = True  # without holes transformers' own positions and masks are the right ones

    def forward(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        keep: int,
        layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mask is None or bool(mask.all()):  # no holes: positions follow the cache length, as in a plain forward
            return hf_compat.forward(self.model, tokens, self.cache, keep, feature_layers=layers, device=self.device)
        return hf_compat.forward(self.model, tokens, self.cache, keep, mask, positions, layers, self.device)

    def crop(self, width: int) -> None:
        hf_compat.rollback(self.cache, width)

    def select(self, rows: torch.Tensor) -> None:
        hf_compat.select_rows(self.cache, rows.to(self.device))

    def make_room(self, mask: torch.Tensor, n: int) -> torch.Tensor:
        return mask  # it grows

    def export(self, length: int) -> object | None:
        return self.cache

    def fill_random(self, batch: int, context: int) -> None:
        self.cache = hf_compat.synthetic_cache(self.model, batch, context)


class StaticStore:
    """One request's view of an arena (``arenas.arenas_of(model).arena(role, …)``): batch row i is arena row
    ``slots[i]``; ``held`` columns are in use. ``seed``: a transformers cache to start from (batch 1; the draft
    prefix store's copy). Forwards of up to ``graph_width`` columns replay recordings; an arena that pads
    (on a GPU) records its widths for the feature ``layers`` the request will ask for as the store opens it."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: int,
        capacity: int,
        role: str,
        graph_width: int,
        seed: object | None = None,
        layers: tuple[int, ...] = (),
    ) -> None:
        self.model, self.role, self.graph_width = model, role, graph_width
        self.arena = arenas_of(model).arena(role, batch, capacity)
        if self.arena.pad:
            self.arena.prime(model, graph_width, layers)
        self.slots = torch.arange(batch, device=model.device)
        self.held = 0
        if seed is not None:
            if batch != 1:
                raise ValueError(f"a seeded cache starts a single row, got batch {batch}")
            for layer, (k, v) in enumerate(hf_compat.cache_tensors(seed)):
                self.arena.keys[layer][:1, :, : k.shape[2]] = k
                self.arena.values[layer][:1, :, : v.shape[2]] = v
            self.held = hf_compat.cache_length(seed)
            self.arena.positions[:1, : self.held] = torch.arange(self.held, device=model.device)

    dense_forward = False  # a recorded forward reads the row mask and positions it was recorded with

    def forward(
        self,
        tokens: torch.Tensor,
        mask: torch.Tensor | None,
        positions: torch.Tensor | None,
        keep: int,
        layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        start = self.held
        logits, features = self.arena.run(
            self.model, self.slots, tokens, positions, mask, start, keep, layers, self.graph_width
        )
        self.held = start + tokens.shape[1]
        return logits.float(), None if features is None else features.float().cpu()

    def crop(self, width: int) -> None:
        self.held = width  # later columns are masked until overwritten

    def select(self, rows: torch.Tensor) -> None:
        self.slots = self.slots[rows.to(self.slots.device)]

    def make_room(self, mask: torch.Tensor, n: int) -> torch.Tensor:
        """Compact every row's tokens to the left when n more columns do not fit; move to an arena twice as
        wide (or wider) when that is not enough."""
        if mask.shape[1] + n <= self.arena.capacity:
            return mask
        lengths = mask.sum(dim=1)  # [b]
        width = int(lengths.max())
        order = torch.argsort((mask == 0).int(), dim=1, stable=True)[:, :width]  # [b, W]: token columns first
        self.arena.gather(self.slots, order.to(self.slots.device))
        self.held = width
        if width + n > self.arena.capacity:
            old = self.arena
            self.arena = arenas_of(self.model).arena(self.role, old.batch, capacity_for(width + n, 0))
            for tensors, new in ((old.keys, self.arena.keys), (old.values, self.arena.values)):
                for src, dst in zip(tensors, new, strict=True):
                    dst[:, :, :width] = src[:, :, :width]
        return (torch.arange(width)[None, :] < lengths[:, None]).long()

    def export(self, length: int) -> object | None:
        slot = int(self.slots[0])
        return hf_compat.dynamic_cache_of(
            self.model,
            [k[slot : slot + 1, :, :length] for k in self.arena.keys],
            [v[slot : slot + 1, :, :length] for v in self.arena.values],
        )

    def fill_random(self, batch: int, context: int) -> None:
        if batch != self.slots.shape[0]:
            raise ValueError(f"this store holds {self.slots.shape[0]} rows, not {batch}")
        first = self.arena.keys[0]
        shape = (self.slots.shape[0], first.shape[1], context, first.shape[3])
        block = torch.randn(shape, device=first.device, dtype=first.dtype)  # one block for every layer
        for tensor in (*self.arena.keys, *self.arena.values):
            tensor[self.slots, :, :context] = block
        self.arena.positions[self.slots, :context] = torch.arange(context, device=first.device)
        self.held = context


def store_kind(model: torch.nn.Module, kv_cache: str) -> str:
    """ "static" or "dynamic": what ``kv_cache`` (``config.KV_CACHES``) gives ``model``: "auto" is an arena on a
    GPU and a ``DynamicCache`` elsewhere or where the architecture needs per-layer masks.

    Raises:
        ValueError: "static" for an architecture an arena cannot serve (``hf_compat.static_kv_reason``).
    """
    reason = hf_compat.static_kv_reason(model)
    if kv_cache == "static" and reason is not None:
        raise ValueError(f"kv_cache='static' cannot serve {type(model).__name__}: {reason}; use kv_cache='dynamic'")
    if kv_cache == "static" or (kv_cache == "auto" and model.device.type == "cuda" and reason is None):
        return "static"
    return "dynamic"


def open_store(
    model: torch.nn.Module,
    batch: int,
    kv_cache: str,
    capacity: int,
    role: str,
    graph_width: int,
    seed: object | None = None,
    layers: tuple[int, ...] = (),
) -> KVStore:
    """Where a request's cache of ``model`` lives (``store_kind``): an arena (``StaticStore``: ``capacity``
    columns, recordings up to ``graph_width`` columns, for feature ``layers``) or a ``DynamicStore``.
    ``seed``: a transformers cache holding a prefix to start from (batch 1). Raises ValueError as
    ``store_kind``."""
    if store_kind(model, kv_cache) == "static":
        return StaticStore(model, batch, capacity, role, graph_width, seed, layers)
    return DynamicStore(model, seed)
