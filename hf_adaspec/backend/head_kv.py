"""A draft head's keys and values on an arena (``static_kv.Arena``), its drafted column a recorded step.

Design: what ``stores.StaticStore`` is for the target and the draft model, ``StaticHeadCache`` is for an EAGLE-3
head (``models.eagle3``): one request's view of the head's arena, an ``Arena`` of one layer (keys and values [B_cap,
kv_heads, L_cap, d] at fixed addresses, a row mask [B_cap, L_cap] on the head's device; batch row i is arena row i).
The host keeps what ``HeadCache`` keeps (each row's entries as a mask [b, W] over the W columns written, and
lengths), so rollback, rows leaving and what each column sees are the same. A block of m entries (a draft's first
column, which ingests what the target confirmed) runs eagerly on the arena; a drafted column (one entry per row: the
token just drafted with the head's own output) replays the arena's recording of width 1, whose static inputs are the
tokens, hidden states and positions [B_cap, 1] and the column it writes [1], the visibility built inside from the
row mask, and whose outputs are the pre-norm outputs and the draft-vocabulary logits. It is recorded at the arena's
first drafted column and reused by later requests (a capture that fails leaves the column eager: ``Arena.record``).
A request that runs out of columns moves to an arena twice as wide (the held columns copied over), which records its
own; a later request starts on the widest. One request per arena at a time: a later request takes it over.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models.eagle3 import Eagle3Head
from . import arena_sizes
from .arenas import arenas_of
from .static_kv import Arena, KVShape

COLUMN = (1, ())  # the arena's key of the drafted column's recording: width 1, no feature layers


@dataclass
class _ColumnInputs:
    """The drafted column's static inputs: tokens and positions [B_cap, 1] long, hidden [B_cap, 1, H] and the
    column written [1] long."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    positions: torch.Tensor
    column: torch.Tensor


def kv_shape(head: Eagle3Head) -> KVShape:
    """The head's one layer of keys and values: (1, kv heads, head dim, dtype)."""
    return 1, head.config.num_kv_heads, head.config.dim, head.dtype


def _column_step(head: Eagle3Head, arena: Arena, inputs: _ColumnInputs) -> Callable[[], tuple]:
    """The recorded step: every arena row's entry (the static tokens, hidden, positions) written at
    ``inputs.column`` → pre-norm outputs [B_cap, 1, H] and draft logits [B_cap, V_d]. It reads the head
    through a weak reference (the arena outlives no head)."""
    ref = weakref.ref(head)

    def step() -> tuple:
        head = ref()
        layer = head.layers[0]
        embeds = head.embed_tokens(inputs.tokens).to(head.dtype)
        residual, q, k, v = layer.project(embeds, inputs.hidden, inputs.positions)
        arena.keys[0].index_copy_(2, inputs.column, k)
        arena.values[0].index_copy_(2, inputs.column, v)
        arena.rowmask.index_fill_(1, inputs.column, True)
        allowed = arena.rowmask[:, None, :] & (arena.column_index <= inputs.column)[None, None, :]  # [B_cap, 1, L_cap]
        out = layer.finish(residual, q, arena.keys[0], arena.values[0], allowed | ~allowed.any(dim=-1, keepdim=True))
        return out, head.draft_logits(out[:, -1])

    return step


class StaticHeadCache:
    """One request's draft-head entries on the head's arena (``models.eagle3.HeadKV``) for ``batch`` rows, held
    empty at first: the arena of ``capacity`` columns (None: the widest the head has for these rows, at least
    ``arena_sizes.CAPACITY_FLOOR``)."""

    def __init__(self, head: Eagle3Head, batch: int, capacity: int | None = None) -> None:
        self.head = head
        capacity = capacity or max(arena_sizes.CAPACITY_FLOOR, arenas_of(head).widest_capacity("head", batch))
        self.arena = arenas_of(head).arena("head", batch, capacity, kv_shape(head))
        self.mask, self.lengths = torch.zeros(batch, 0, dtype=torch.bool), torch.zeros(batch, dtype=torch.long)
        self.arena.rowmask.zero_()

    @property
    def capacity(self) -> int:
        """Columns of the arena the request is on."""
        return self.arena.capacity

    @property
    def k(self) -> torch.Tensor:
        return self.arena.keys[0][: self.mask.shape[0]]

    @property
    def v(self) -> torch.Tensor:
        return self.arena.values[0][: self.mask.shape[0]]

    def _room(self, m: int) -> int:
        """The first column of a block of m, the request moved first to a wider arena if it would run past
        this one's columns."""
        start, old = self.mask.shape[1], self.arena
        if start + m > old.capacity:
            wider = max(2 * old.capacity, 1 << (start + m - 1).bit_length())
            self.arena = arenas_of(self.head).arena("head", old.batch, wider, kv_shape(self.head))
            self.arena.rowmask.zero_()
            self.arena.keys[0][:, :, :start], self.arena.values[0][:, :, :start] = (
                old.keys[0][:, :, :start],
                old.values[0][:, :, :start],
            )
            self.arena.rowmask[:, :start] = old.rowmask[:, :start]
        return start

    def add(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """``HeadCache.add`` on the arena: k, v [b, kv_heads, M, d] written at the next M columns → what each
        block column attends to, [b, M, L_cap] bool on the head's device."""
        b, m = valid.shape
        start, arena = self._room(m), self.arena
        arena.keys[0][:b, :, start : start + m], arena.values[0][:b, :, start : start + m] = k, v
        arena.rowmask[:b, start : start + m] = valid.to(arena.device)
        self.mask, self.lengths = torch.cat([self.mask, valid], dim=1), self.lengths + valid.long().sum(dim=1)
        own = start + torch.arange(m, device=arena.device)  # [M]
        allowed = (arena.column_index[None, :] <= own[:, None])[None] & arena.rowmask[:b, None, :]  # [b, M, L_cap]
        return allowed | ~allowed.any(dim=-1, keepdim=True)

    @torch.no_grad()
    def draft_column(
        self, head: Eagle3Head, tokens: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``HeadCache.draft_column`` by the recording: tokens [b, 1], hidden [b, 1, H] → pre-norm outputs
        [b, 1, H] (a copy) and float32 logits [b, V] on the CPU. Raises ValueError for another head."""
        if head is not self.head:
            raise ValueError("this cache belongs to another head")
        b, start = tokens.shape[0], self._room(1)
        arena = self.arena
        inputs = arena.inputs.get(COLUMN)
        if inputs is None:
            rows, device = arena.batch, arena.device
            ids = torch.zeros(rows, 1, dtype=torch.long, device=device)
            inputs = arena.inputs[COLUMN] = _ColumnInputs(
                ids,
                torch.zeros(rows, 1, head.config.hidden_size, dtype=head.dtype, device=device),
                torch.zeros_like(ids),
                torch.zeros(1, dtype=torch.long, device=device),
            )
        inputs.tokens.zero_()
        inputs.tokens[:b] = tokens.to(arena.device)
        inputs.hidden[:b] = hidden.to(arena.device, inputs.hidden.dtype)
        inputs.positions[:b] = (self.lengths + 1)[:, None].to(arena.device)
        inputs.column.fill_(start)
        step = _column_step(head, arena, inputs)
        if COLUMN not in arena.recordings:
            arena.record(COLUMN, step)
        recording = arena.recordings[COLUMN]
        if recording is None:  # its capture failed: the same step, eagerly
            out, draft = step()
        else:
            recording.captured.replay()
            out, draft = recording.out
        self.mask = torch.cat([self.mask, torch.ones(b, 1, dtype=torch.bool)], dim=1)
        self.lengths = self.lengths + 1
        return out[:b].clone(), head.widen(draft[:b])

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep each row's first ``lengths`` [b] entries; later columns are masked until written again."""
        kept = (self.mask.long().cumsum(dim=1) <= lengths[:, None]) & self.mask
        used = kept.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else 0
        self.mask, self.lengths = kept[:, :width], torch.minimum(self.lengths, lengths)
        self.arena.rowmask.zero_()
        self.arena.rowmask[: kept.shape[0], :width] = self.mask.to(self.arena.device)

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` ([b'] long indices) in the arena's first b' rows."""
        arena, on = self.arena, rows.to(self.arena.device)
        arena.keys[0][: rows.shape[0]], arena.values[0][: rows.shape[0]] = arena.keys[0][on], arena.values[0][on]
        kept = arena.rowmask[on]
        arena.rowmask.zero_()
        arena.rowmask[: rows.shape[0]] = kept
        self.mask, self.lengths = self.mask[rows], self.lengths[rows]
