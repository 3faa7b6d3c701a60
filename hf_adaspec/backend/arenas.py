"""Who owns a model's arenas: ``ModelArenas``, one per model object, holds its preallocated KV arenas (per role,
rows and columns; ``static_kv.Arena``, with their recordings) and the widths its recordings compile.

Arenas and recordings belong to a module object, not to its weights: a recording reads the parameters at the
addresses it was made with (a CUDA graph holds them), so two objects with equal weights never share one.
``arenas_of(model)`` is the one way to reach a model's owner; it lives as long as the model does (kept weakly),
so a request, a cost probe, a check or a test that opens a cache on the model finds the arenas and recordings
the previous one made. ``engine.owner.ModelState`` holds its target's for the requests it serves.

Contract: one request per model at a time (a later request that opens an arena of the same size takes it
over, ``static_kv``): a request holds each model it runs (``ModelArenas.hold``); a second request from another
thread waits, one from inside the first on the same thread (a streamer or step callback that calls ``generate``)
raises. ``engine.owner.ModelState`` holds its target and the request's assistant.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch

from . import arena_sizes, static_kv
from .graphs import capture_for
from .static_kv import Arena, CaptureRecord, KVShape


class ModelArenas:
    """One model object's arenas, keyed (role, B_cap, L_cap), the most recently used last, at most
    ``static_kv.ARENAS_PER_ROLE`` per role; and ``compiled``, the widths its arenas record through
    ``torch.compile`` (``compile``). Holds the model weakly."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)
        self._arenas: dict[tuple[str, int, int], Arena] = {}
        self.compiled: frozenset[int] = frozenset()
        self._lock = threading.Lock()
        self._holder: int | None = None  # the thread in a request on this model

    @property
    def model(self) -> torch.nn.Module:
        """The model these arenas are of.

        Raises:
            ReferenceError: it was collected.
        """
        model = self._model()
        if model is None:
            raise ReferenceError("the model of these arenas was collected")
        return model

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """The model is in one request for the span of the block: another thread's ``hold`` waits until it ends.

        Raises:
            RuntimeError: the calling thread already holds it (a request started inside another on this model).
        """
        if self._holder == threading.get_ident():
            raise RuntimeError(
                f"a speculative generate on {type(self.model).__name__} started inside another on the "
                "same model (a streamer or speculation_callback that calls generate?): hf-adaspec runs "
                "one request per model at a time; generate after the first returns, or on another model"
            )
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def arena(self, role: str, batch: int, capacity: int, shape: KVShape | None = None) -> Arena:
        """The arena for ``role`` ("target", "draft", "head", "probe", …) with room for ``batch`` rows (rounded
        up to a power of two) and ``capacity`` columns of keys and values of ``shape`` (None: the model's), made
        on first use: recordings are CUDA graphs on a GPU and ``graphs.Rerun`` stand-ins elsewhere; a role's
        least recently used arena gives way past ``static_kv.ARENAS_PER_ROLE``."""
        model = self.model
        key = (role, arena_sizes.next_power(batch), capacity)
        arena = self._arenas.pop(key, None)
        if arena is None:
            mine = [k for k in self._arenas if k[0] == role]
            for old in mine[: max(0, len(mine) - static_kv.ARENAS_PER_ROLE + 1)]:
                del self._arenas[old]
            device = model.device
            arena = Arena(
                model,
                key[1],
                capacity,
                capture_for(device),
                choose_by_time=device.type == "cuda",
                pad=device.type in static_kv.PAD_DEVICES,
                shape=shape,
                compiled=self.compiled,
            )
        self._arenas[key] = arena  # most recently used last
        return arena

    def adopt(self, role: str, arena: Arena) -> None:
        """Keep ``arena`` (made for this model, e.g. with a capture of the caller's) as the one for ``role`` at
        its rows and columns, in place of any there."""
        self._arenas.pop((role, arena.batch, arena.capacity), None)
        self._arenas[(role, arena.batch, arena.capacity)] = arena

    def kept(self, role: str, batch: int, capacity: int) -> Arena:
        """The arena kept for ``role`` at ``batch`` rows (rounded up to a power of two) and ``capacity`` columns.

        Raises:
            KeyError: none is kept there.
        """
        return self._arenas[(role, arena_sizes.next_power(batch), capacity)]

    def widest_capacity(self, role: str, batch: int) -> int:
        """Columns of the widest arena kept for ``role`` with room for ``batch`` rows (0: none)."""
        rows = arena_sizes.next_power(batch)
        return max((capacity for r, b, capacity in self._arenas if (r, b) == (role, rows)), default=0)

    def compile(self, widths: frozenset[int]) -> None:
        """Record the forwards of these widths through ``torch.compile`` (inductor fuses the element-wise kernels
        a decoding step is made of; seconds to minutes at each width's first recording) in arenas made from now
        on, and drop the arenas made before (the next request records again). An empty set: plain recordings."""
        self.compiled = frozenset(widths)
        self.drop()

    def drop(self) -> None:
        """Forget every arena and its recordings (the next request records again)."""
        self._arenas.clear()

    def records(self) -> list[CaptureRecord]:
        """Every recording made in the arenas still kept (what capturing cost, per width)."""
        return [r for arena in self._arenas.values() for r in arena.records]


_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → its ModelArenas


def arenas_of(model: torch.nn.Module) -> ModelArenas:
    """``model``'s ``ModelArenas``, made at first use and kept as long as the model lives."""
    owner = _OWNERS.get(model)
    if owner is None:
        owner = _OWNERS[model] = ModelArenas(model)
    return owner
