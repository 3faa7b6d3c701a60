"""A KV cache for a static batch whose rows hold different numbers of tokens.

Design: every row shares one physical cache length L, and a mask [B, L] says which positions are real
tokens of that row (1) and which are holes (0): left padding of the prompt, padding of a ragged block, or
draft tokens that verification rejected. RoPE positions come from each row's own token count, so a row
with holes computes exactly what it would alone. Rolling a row back to its first m tokens only clears mask
bits; columns that no row still uses are cropped off the end. Finished rows leave the batch with
``select``. The mask and lengths live on the CPU; the keys and values in a store (``stores``): a
transformers ``DynamicCache`` (the CPU's), or a preallocated arena whose narrow forwards replay recorded
CUDA graphs (a GPU's; ``kv_cache="static"``), which may compact the rows' tokens to the left when it runs out
of columns. Logits come back on the model's device.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .stores import DynamicStore, KVStore


class KVCache(Protocol):
    """What the engine and a paid drafter need from a model's cache over a batch (``RaggedCache``, or the
    replay's stand-in that answers from traces). lengths: [B] long, tokens held per row."""

    @property
    def lengths(self) -> torch.Tensor: ...

    def held(self) -> list[int]:
        """Tokens held per row, as ints."""
        ...

    def append(self, tokens: torch.Tensor, valid: torch.Tensor | None, keep: int) -> torch.Tensor:
        """Feed tokens [B, M] (``valid`` [B, M] bool marks real ones; None: all are) → float32 logits
        [B, keep, V]."""
        ...

    def append_features(
        self, tokens: torch.Tensor, valid: torch.Tensor | None, keep: int, layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``append``, and the residual stream at the inputs of ``layers`` for every column
        ([B, M, len(layers)·H]; None without layers)."""
        ...

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep only the first ``lengths`` [B] tokens of each row."""
        ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` ([b] long indices)."""
        ...

    def export_prefix(self) -> object | None:
        """A transformers cache of a single row's tokens for the draft prefix store, which keeps it (the cache
        is not used after); None where there is none to keep (a batch, a row with holes, a stand-in)."""
        ...


class RaggedCache:
    """KV cache + hole mask for a batch of rows of different lengths.

    mask: [B, L] long (1 = a token of that row); lengths: [B] long, tokens held per row. While no row has a
    hole the mask is not kept (it is all ones: made when asked) and, where the store allows it
    (``KVStore.dense_forward``), a forward passes neither mask nor positions: the per-step bookkeeping of the
    common case (one row, or rows that advance together) is a few integer updates.
    """

    def __init__(
        self, model: torch.nn.Module, batch: int, cache: object | None = None, store: KVStore | None = None
    ) -> None:
        """``cache``: a transformers cache of ``batch`` rows that already holds the same number of tokens
        in every row (a reused prompt prefix, ``draft_prefix``), or ``store``: where the keys and values live
        (a ``StaticStore``, possibly seeded); neither: an empty ``DynamicCache``."""
        if cache is not None and store is not None:
            raise ValueError("give a cache to start from or a store, not both")
        self.model = model
        self.store = store if store is not None else DynamicStore(model, cache)
        self._reset(batch, self.store.held)

    def _reset(self, batch: int, held: int) -> None:
        """Every row holds ``held`` tokens in the first ``held`` columns: no holes."""
        self._batch, self._width, self._mask = batch, held, None  # _mask None: all ones [batch, _width]
        self._held, self._lengths = [held] * batch, None  # the lengths as ints; their tensor, made when asked

    @property
    def batch(self) -> int:
        """Rows in the batch."""
        return self._batch

    @property
    def mask(self) -> torch.Tensor:
        """[B, L] long: 1 where a column holds a token of that row."""
        if self._mask is None:
            return torch.ones(self._batch, self._width, dtype=torch.long)
        return self._mask

    @property
    def lengths(self) -> torch.Tensor:
        """[B] long: tokens held per row."""
        if self._lengths is None:
            self._lengths = torch.tensor(self._held, dtype=torch.long)
        return self._lengths

    def held(self) -> list[int]:
        """Tokens held per row, as ints (``lengths`` without a tensor)."""
        return list(self._held)

    def _set(self, mask: torch.Tensor, held: list[int]) -> None:
        self._mask, self._width, self._held, self._lengths = mask, mask.shape[1], held, None
        if bool(mask.all()):
            self._mask = None

    def append(self, tokens: torch.Tensor, valid: torch.Tensor | None, keep: int) -> torch.Tensor:
        """Feed a block of tokens [B, M] where ``valid`` [B, M] bool marks each row's real tokens (None: all).

        Returns float32 logits [B, keep, V] of the block's last ``keep`` columns, on the model's device.
        """
        return self.append_features(tokens, valid, keep, ())[0]

    def append_features(
        self, tokens: torch.Tensor, valid: torch.Tensor | None, keep: int, layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``append``, also returning the residual stream at the inputs of ``layers`` for every column of
        the block, concatenated: [B, M, len(layers)·H] float32 on the CPU (None without layers)."""
        n = tokens.shape[1]
        if valid is None and self._mask is None and self.store.dense_forward:  # no holes before or now
            logits, features = self.store.forward(tokens, None, None, keep, layers)
            self._width, self._held, self._lengths = self._width + n, [h + n for h in self._held], None
            return logits, features
        before = self.store.make_room(self.mask, n)
        valid = torch.ones(tokens.shape, dtype=torch.bool) if valid is None else valid.cpu()
        offsets = valid.long().cumsum(dim=1) - 1  # [B, M]: index of each token among the row's new ones
        position_ids = self.lengths[:, None] + offsets.clamp_min(0)  # [B, M]
        mask = torch.cat([before, valid.long()], dim=1)  # [B, L + M]
        logits, features = self.store.forward(tokens, mask, position_ids, keep, layers)
        counts = valid.sum(dim=1).tolist()
        self._set(mask, [h + c for h, c in zip(self._held, counts, strict=True)])
        return logits, features

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep only the first ``lengths`` [B] tokens of each row; crop columns no row uses any more."""
        wanted = lengths.tolist()
        if all(w >= h for w, h in zip(wanted, self._held, strict=True)) and (
            self._mask is None or not self._width or bool(self._mask[:, -1].any())
        ):
            return  # every row keeps all it holds and the last column is in use: nothing changes (a plain step)
        mask = self.mask
        kept = (mask.cumsum(dim=1) <= lengths[:, None]) & mask.bool()  # [B, L]
        used = kept.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else 0
        if width < kept.shape[1]:
            self.store.crop(width)
        self._set(kept[:, :width].long(), [min(h, w) for h, w in zip(self._held, wanted, strict=True)])

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` ([b] long indices), dropping the others (finished requests)."""
        self.store.select(rows)
        kept = rows.tolist()
        self._batch = len(kept)
        self._set(self.mask[rows], [self._held[i] for i in kept])

    def export_prefix(self) -> object | None:
        if self._batch != 1 or self._mask is not None:
            return None
        return self.store.export(self._width)

    def fill_random(self, context: int) -> None:
        """Hold ``context`` tokens of random keys and values in every row (a cost probe's context: attention's
        cost does not depend on the values)."""
        self.store.fill_random(self._batch, context)
        self._reset(self._batch, context)


def left_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D token rows right-aligned: → tokens [B, M] long and valid [B, M] bool (M = longest)."""
    width = max(int(r.shape[0]) for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        if r.shape[0]:
            tokens[i, width - r.shape[0] :], valid[i, width - r.shape[0] :] = r, True
    return tokens, valid


def right_pad(rows: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D token rows left-aligned: → tokens [B, M] long and valid [B, M] bool (M = longest)."""
    width = max(int(r.shape[0]) for r in rows)
    if all(r.shape[0] == width for r in rows):  # nothing to pad (every plain step)
        return torch.stack(rows), torch.ones(len(rows), width, dtype=torch.bool)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, : r.shape[0]], valid[i, : r.shape[0]] = r, True
    return tokens, valid
