"""A draft head's keys and values preallocated, its drafted column a recorded step (a CUDA graph on a GPU).

Design: what ``backend.static_kv`` does for the target and the draft model, for an EAGLE-3 head (``eagle3``).
A ``HeadArena`` per (head, B_cap) holds keys and values [B_cap, kv_heads, L_cap, d] at fixed addresses and a
row mask [B_cap, L_cap] on the head's device (B_cap a power of two); the host keeps what ``HeadCache`` keeps
(each row's entries as a mask [b, W] over the W columns written, and lengths), so rollback, rows leaving
and what each column sees are the same. A block of m entries (a draft's first column, which ingests what
the target confirmed) runs eagerly on the arena; a drafted column (one entry per row: the token just
drafted with the head's own output) replays one recording whose static inputs are the tokens, hidden
states and positions [B_cap, 1] and the column it writes [1], the visibility built inside from the row
mask, and whose outputs are the pre-norm outputs and the draft-vocabulary logits. It is recorded at the
arena's first drafted column (``capture``, given by the caller: ``backend.graphs.CudaGraphs`` on a GPU, its
``Rerun`` stand-in elsewhere) and reused by later requests; what capturing took is kept in ``records`` (ms).
An arena that runs out of columns grows to twice the width and records again. One request per arena at a
time: a later request takes it over.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch

from .eagle3 import Eagle3Head, HeadCache, HeadKV

CAPACITY_FLOOR = 256  # columns of a new arena
Capture = Callable[[Callable[[], tuple]], tuple[object, tuple]]  # ``backend.graphs.Capture``


def _rows_for(batch: int) -> int:
    """B_cap: the next power of two ≥ ``batch``."""
    return max(1, 1 << max(0, batch - 1).bit_length())


class HeadArena:
    """One head's preallocated keys and values for up to B_cap rows, and its recorded drafted column."""

    def __init__(self, head: Eagle3Head, batch: int, capture: Capture, capacity: int = CAPACITY_FLOOR) -> None:
        c, self.device = head.config, head.device
        self.head, self.capture, self.rows = weakref.ref(head), capture, _rows_for(batch)
        self.tokens = torch.zeros(self.rows, 1, dtype=torch.long, device=self.device)
        self.hidden = torch.zeros(self.rows, 1, c.hidden_size, dtype=head.dtype, device=self.device)
        self.positions = torch.zeros_like(self.tokens)
        self.column = torch.zeros(1, dtype=torch.long, device=self.device)
        self.records: list[float] = []
        self.capacity, self.keys, self.values, self.rowmask = 0, torch.zeros(0), torch.zeros(0), torch.zeros(0)
        self._allocate(capacity)
        self.start(batch)

    def _allocate(self, capacity: int) -> None:
        """Keys, values and row mask of ``capacity`` columns (the held columns copied over); records again."""
        head = self.head()
        shape = (self.rows, head.config.num_kv_heads, capacity, head.config.dim)
        keys, values = (torch.zeros(shape, dtype=head.dtype, device=self.device) for _ in range(2))
        rowmask = torch.zeros(self.rows, capacity, dtype=torch.bool, device=self.device)
        if self.capacity:
            keys[:, :, : self.capacity], values[:, :, : self.capacity] = self.keys, self.values
            rowmask[:, : self.capacity] = self.rowmask
        self.keys, self.values, self.rowmask, self.capacity = keys, values, rowmask, capacity
        self.column_index = torch.arange(capacity, device=self.device)
        self.recording: tuple[object, tuple] | None = None

    def start(self, batch: int) -> None:
        """Hold nothing, for a request of ``batch`` ≤ B_cap rows."""
        self.mask, self.lengths = torch.zeros(batch, 0, dtype=torch.bool), torch.zeros(batch, dtype=torch.long)
        self.rowmask.zero_()

    @property
    def k(self) -> torch.Tensor:
        return self.keys[: self.mask.shape[0]]

    @property
    def v(self) -> torch.Tensor:
        return self.values[: self.mask.shape[0]]

    def _room(self, m: int) -> int:
        """The first column of a block of m, the arena grown first if it would run past its columns."""
        start = self.mask.shape[1]
        if start + m > self.capacity:
            self._allocate(max(2 * self.capacity, 1 << (start + m - 1).bit_length()))
        return start

    def add(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``HeadCache.add`` on the arena: k, v [b, kv_heads, M, d] written at the next M columns → what each
        block column attends to, [b, M, L_cap] bool on the head's device."""
        b, m = valid.shape
        start = self._room(m)
        self.keys[:b, :, start : start + m], self.values[:b, :, start : start + m] = k, v
        self.rowmask[:b, start : start + m] = valid.to(self.device)
        self.mask, self.lengths = torch.cat([self.mask, valid], dim=1), self.lengths + valid.long().sum(dim=1)
        own = start + torch.arange(m, device=self.device)  # [M]
        allowed = (self.column_index[None, :] <= own[:, None])[None] & self.rowmask[:b, None, :]  # [b, M, L_cap]
        return allowed | ~allowed.any(dim=-1, keepdim=True)

    def _column(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The recorded step: every arena row's entry (static tokens, hidden, positions) written at ``column``
        → pre-norm outputs [B_cap, 1, H] and draft logits [B_cap, V_d]."""
        head = self.head()
        layer = head.layers[0]
        embeds = head.embed_tokens(self.tokens).to(head.dtype)
        residual, q, k, v = layer.project(embeds, self.hidden, self.positions)
        self.keys.index_copy_(2, self.column, k)
        self.values.index_copy_(2, self.column, v)
        self.rowmask.index_fill_(1, self.column, True)
        allowed = self.rowmask[:, None, :] & (self.column_index <= self.column)[None, None, :]  # [B_cap, 1, L_cap]
        out = layer.finish(residual, q, self.keys, self.values, allowed | ~allowed.any(dim=-1, keepdim=True))
        return out, head.draft_logits(out[:, -1])

    @torch.no_grad()
    def draft_column(self, head: Eagle3Head, tokens: torch.Tensor, hidden: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """``HeadCache.draft_column`` by the recording: tokens [b, 1], hidden [b, 1, H] → pre-norm outputs
        [b, 1, H] (a copy) and float32 logits [b, V] on the CPU. Raises ValueError for another head."""
        if head is not self.head():
            raise ValueError("this arena belongs to another head")
        b, start = tokens.shape[0], self._room(1)
        self.tokens.zero_()
        self.tokens[:b] = tokens.to(self.device)
        self.hidden[:b] = hidden.to(self.device, self.hidden.dtype)
        self.positions[:b] = (self.lengths + 1)[:, None].to(self.device)
        self.column.fill_(start)
        if self.recording is None:
            began = time.perf_counter()
            self.recording = self.capture(self._column)
            self.records.append(round((time.perf_counter() - began) * 1000.0, 2))
        self.recording[0].replay()
        out, draft = self.recording[1]
        self.mask = torch.cat([self.mask, torch.ones(b, 1, dtype=torch.bool)], dim=1)
        self.lengths = self.lengths + 1
        return out[:b].clone(), head.widen(draft[:b])

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep each row's first ``lengths`` [b] entries; later columns are masked until written again."""
        kept = (self.mask.long().cumsum(dim=1) <= lengths[:, None]) & self.mask
        used = kept.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else 0
        self.mask, self.lengths = kept[:, :width], torch.minimum(self.lengths, lengths)
        self.rowmask.zero_()
        self.rowmask[: kept.shape[0], :width] = self.mask.to(self.device)

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` ([b'] long indices) in the arena's first b' rows."""
        on = rows.to(self.device)
        self.keys[: rows.shape[0]], self.values[: rows.shape[0]] = self.keys[on], self.values[on]
        kept = self.rowmask[on]
        self.rowmask.zero_()
        self.rowmask[: rows.shape[0]] = kept
        self.mask, self.lengths = self.mask[rows], self.lengths[rows]


_ARENAS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # head → {B_cap: HeadArena}


def head_cache(head: Eagle3Head, batch: int, kv_cache: str, capture: Callable[[], Capture]) -> HeadKV:
    """Where a request's head entries live: with ``kv_cache`` "static", or "auto" on a GPU, the head's arena
    for ``batch`` rows (made on first use, ``capture()`` recording its drafted column), taken over for this
    request; else, or where the target's embedding is on another device than the head, a ``HeadCache``."""
    shared = head.embed_tokens.weight.device == head.device  # the recording reads the target's embedding
    if not shared or (kv_cache != "static" and not (kv_cache == "auto" and head.device.type == "cuda")):
        return HeadCache(batch)
    arenas = _ARENAS.setdefault(head, {})
    rows = _rows_for(batch)
    if rows not in arenas:
        arenas[rows] = HeadArena(head, batch, capture(), CAPACITY_FLOOR)
    arenas[rows].start(batch)
    return arenas[rows]


def arena_records(head: Eagle3Head) -> list[float]:
    """The ms each recording of ``head``'s arenas took to capture."""
    return [ms for arena in _ARENAS.get(head, {}).values() for ms in arena.records]
