"""Every KV cache a request runs on is made here: the target's and a draft model's (a ``RaggedCache`` over a
store, ``stores.open_store``: an arena or a ``DynamicCache``) and a draft head's (a ``HeadCache``, or a
``head_kv.StaticHeadCache`` on an arena).

``ModelCaches`` makes one ``generate`` request's, sized for it (``engine.run.build_run`` asks it for each);
``open_cache`` and ``open_head_cache`` make one cache each, as a cost probe, a trace or a check needs it.
Where each lives follows ``kv_cache`` (``config.KV_CACHES``): "static" an arena, "dynamic" a growing cache,
"auto" an arena on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.eagle3 import Eagle3Head, HeadCache, HeadKV
from .arena_sizes import capacity_for
from .draft_prefix import PrefixSeed
from .head_kv import StaticHeadCache
from .ragged import RaggedCache
from .stores import open_store

NEW_TOKENS_SIZED = 1024  # a request's arena is first sized for at most this many new tokens; a longer one moves


def open_cache(
    model: torch.nn.Module,
    batch: int,
    kv_cache: str = "dynamic",
    capacity: int = 0,
    role: str = "target",
    graph_width: int = 1,
    seed: object | None = None,
    layers: tuple[int, ...] = (),
) -> RaggedCache:
    """An empty ``RaggedCache`` of ``model`` for ``batch`` rows (``seed``: a transformers cache holding a
    prefix to start from, batch 1), its keys and values where ``kv_cache`` puts them: the arena of ``role``
    with ``capacity`` columns whose forwards of up to ``graph_width`` columns (for feature ``layers``) replay
    recordings, or a ``DynamicCache``. Raises ValueError as ``stores.store_kind``."""
    return RaggedCache(
        model, batch, store=open_store(model, batch, kv_cache, capacity, role, graph_width, seed, layers)
    )


def open_head_cache(head: Eagle3Head, batch: int, kv_cache: str = "dynamic") -> HeadKV:
    """Where ``head``'s entries for ``batch`` rows live: with ``kv_cache`` "static", or "auto" on a GPU, its
    arena (``StaticHeadCache``), taken over for this request; else, or where the target's embedding is on
    another device than the head (the recording reads it), a ``HeadCache``."""
    arena = kv_cache == "static" or (kv_cache == "auto" and head.device.type == "cuda")
    if not arena or head.embed_tokens.weight.device != head.device:
        return HeadCache(batch)
    return StaticHeadCache(head, batch)


@dataclass(frozen=True)
class ModelCaches:
    """A ``generate`` request's caches (``engine.run.Caches``) of the real target and its ``assistant`` (a
    draft model or a draft head; None), where ``kv_cache`` says: arenas of ``capacity`` columns whose forwards
    of up to ``graph_width`` columns replay recordings, or growing caches."""

    target_model: torch.nn.Module
    assistant: torch.nn.Module | None = None
    kv_cache: str = "dynamic"
    capacity: int = 0
    graph_width: int = 1

    @classmethod
    def for_request(
        cls,
        target: torch.nn.Module,
        assistant: torch.nn.Module | None,
        kv_cache: str,
        k_max: int,
        width: int,
        max_length: int,
    ) -> ModelCaches:
        """Sized for a request of a ``width``-token padded prompt, up to ``max_length`` tokens in all (at most
        ``NEW_TOKENS_SIZED`` new) and one proposal of up to ``k_max`` tokens; recordings up to k_max + 1 wide."""
        new = min(max(max_length - width, 0), NEW_TOKENS_SIZED) + k_max + 1
        return cls(target, assistant, kv_cache, capacity_for(width, new), k_max + 1)

    def target(self, batch: int, layers: tuple[int, ...] = ()) -> RaggedCache:
        return open_cache(
            self.target_model, batch, self.kv_cache, self.capacity, "target", self.graph_width, layers=layers
        )

    def draft(self, batch: int, seed: PrefixSeed | None) -> RaggedCache:
        if self.assistant is None:
            raise ValueError("no draft model to make a cache for")
        return open_cache(
            self.assistant,
            batch,
            self.kv_cache,
            self.capacity,
            "draft",
            self.graph_width,
            seed.cache if seed is not None else None,
        )

    def head(self, batch: int) -> HeadKV:
        if not isinstance(self.assistant, Eagle3Head):
            raise ValueError("no draft head to make a cache for")
        return open_head_cache(self.assistant, batch, self.kv_cache)
