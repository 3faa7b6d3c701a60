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

    lengths: torch.Tensor

    def append(self, tokens: torch.Tensor, valid: torch.Tensor | None, keep: int) -> torch.Tensor:
        """Feed tokens [B, M] (``valid`` [B, M] bool marks real ones; None: all are) → float32 logits
        [B, keep, V]."""
        ...

    def append_features(self, tokens: torch.Tensor, valid: torch.Tensor | None, keep: int, layers: tuple[int, ...]
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

    mask: [B, L] long (1 = a token of that row); lengths: [B] long, tokens held per row.
    """

    def __init__(self, model: torch.nn.Module, batch: int, cache: object | None = None,
                 store: KVStore | None = None) -> None:
        """``cache``: a transformers cache of ``batch`` rows that already holds the same number of tokens
        in every row (a reused prompt prefix, ``draft_prefix``), or ``store``: where the keys and values live
        (a ``StaticStore``, possibly seeded); neither: an empty ``DynamicCache``."""
        if cache is not None and store is not None:
            raise ValueError("give a cache to start from or a store, not both")
        self.model = model
        self.store = store if store is not None else DynamicStore(model, cache)
        held = self.store.held
        self.mask = torch.ones(batch, held, dtype=torch.long)
        self.lengths = torch.full((batch,), held, dtype=torch.long)
        self._held, self._dense = [held] * batch, True  # the lengths as ints; whether the mask is all ones

    @property
    def batch(self) -> int:
        """Rows in the batch."""
        return self.mask.shape[0]

    def append(self, tokens: torch.Tensor, valid: torch.Tensor | None, keep: int) -> torch.Tensor:
        """Feed a block of tokens [B, M] where ``valid`` [B, M] bool marks each row's real tokens (None: all).

        Returns float32 logits [B, keep, V] of the block's last ``keep`` columns, on the model's device.
        """
        return self.append_features(tokens, valid, keep, ())[0]

    def append_features(self, tokens: torch.Tensor, valid: torch.Tensor | None, keep: int, layers: tuple[int, ...]
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``append``, also returning the residual stream at the inputs of ``layers`` for every column of
        the block, concatenated: [B, M, len(layers)·H] float32 on the CPU (None without layers)."""
        n = tokens.shape[1]
        self.mask = self.store.make_room(self.mask, n)
        if valid is None:  # every column real: positions follow each row's length
            position_ids = self.lengths[:, None] + torch.arange(n)  # [B, M]
            mask = torch.cat([self.mask, torch.ones(self.batch, n, dtype=torch.long)], dim=1)  # [B, L + M]
            counts = [n] * self.batch
        else:
            valid = valid.cpu()
            offsets = valid.long().cumsum(dim=1) - 1  # [B, M]: index of each token among the row's new ones
            position_ids = self.lengths[:, None] + offsets.clamp_min(0)  # [B, M]
            mask = torch.cat([self.mask, valid.long()], dim=1)  # [B, L + M]
            counts = valid.sum(dim=1).tolist()
            self._dense = self._dense and min(counts) == n
        logits, features = self.store.forward(tokens, mask, position_ids, keep, layers)
        self.mask = mask
        self._held = [h + c for h, c in zip(self._held, counts, strict=True)]
        self.lengths = torch.tensor(self._held, dtype=torch.long)
        return logits, features

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep only the first ``lengths`` [B] tokens of each row; crop columns no row uses any more."""
        wanted = lengths.tolist()
        if all(w >= h for w, h in zip(wanted, self._held, strict=True)) and \
                (self._dense or not self.mask.shape[1] or bool(self.mask[:, -1].any())):
            return  # every row keeps all it holds and the last column is in use: nothing changes (a plain step)
        kept = (self.mask.cumsum(dim=1) <= lengths[:, None]) & self.mask.bool()  # [B, L]
        self.mask = kept.long()
        self._held = [min(h, w) for h, w in zip(self._held, wanted, strict=True)]
        self.lengths = torch.tensor(self._held, dtype=torch.long)
        used = kept.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else 0
        if width < self.mask.shape[1]:
            self.store.crop(width)
            self.mask = self.mask[:, :width]
        self._dense = bool(self.mask.all())

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` ([b] long indices), dropping the others (finished requests)."""
        self.store.select(rows)
        self.mask, self.lengths = self.mask[rows], self.lengths[rows]
        self._held = self.lengths.tolist()
        self._dense = bool(self.mask.all())

    def export_prefix(self) -> object | None:
        if self.batch != 1 or not bool(self.mask.all()):
            return None
        return self.store.export(self.mask.shape[1])

    def fill_random(self, context: int) -> None:
        """Hold ``context`` tokens of random keys and values in every row (a cost probe's context: attention's
        cost does not depend on the values)."""
        self.store.fill_random(self.batch, context)
        self.mask = torch.ones(self.batch, context, dtype=torch.long)
        self.lengths = torch.full((self.batch,), context, dtype=torch.long)
        self._held, self._dense = [context] * self.batch, True


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
