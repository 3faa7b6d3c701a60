"""A KV cache for a static batch whose rows hold different numbers of tokens.

Design: every row shares one physical cache length L (a transformers ``DynamicCache``), and a mask
[B, L] says which positions are real tokens of that row (1) and which are holes (0): left padding of
the prompt, padding of a ragged block, or draft tokens that verification rejected. RoPE positions
come from each row's own token count, so a row with holes computes exactly what it would alone.
Rolling a row back to its first m tokens only clears mask bits; columns that no row still uses are
cropped off the end. Finished rows leave the batch with ``select``. The mask, lengths and logits live on
the CPU; ``hf_compat``'s forwards move a block to the model's device and its logits back.
"""

from __future__ import annotations

from typing import Protocol

import torch

from . import hf_compat


class KVCache(Protocol):
    """What the engine and a paid drafter need from a model's cache over a batch (``RaggedCache``, or the
    replay's stand-in that answers from traces). lengths: [B] long, tokens held per row; ``cache``: the
    transformers cache underneath (None for a stand-in)."""

    lengths: torch.Tensor
    cache: object | None

    def append(self, tokens: torch.Tensor, valid: torch.Tensor, keep: int) -> torch.Tensor:
        """Feed tokens [B, M] (``valid`` [B, M] bool marks real ones) → float32 logits [B, keep, V]."""
        ...

    def append_features(self, tokens: torch.Tensor, valid: torch.Tensor, keep: int, layers: tuple[int, ...]
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


class RaggedCache:
    """KV cache + hole mask for a batch of rows of different lengths.

    mask: [B, L] long (1 = a token of that row); lengths: [B] long, tokens held per row.
    """

    def __init__(self, model: torch.nn.Module, batch: int, cache: object | None = None) -> None:
        """``cache``: a transformers cache of ``batch`` rows that already holds the same number of tokens
        in every row (a reused prompt prefix, ``draft_prefix``); None: an empty one."""
        self.model = model
        self.cache = cache if cache is not None else hf_compat.new_cache(model)
        held = hf_compat.cache_length(self.cache)
        self.mask = torch.ones(batch, held, dtype=torch.long)
        self.lengths = torch.full((batch,), held, dtype=torch.long)

    @property
    def batch(self) -> int:
        """Rows in the batch."""
        return self.mask.shape[0]

    def append(self, tokens: torch.Tensor, valid: torch.Tensor, keep: int) -> torch.Tensor:
        """Feed a block of tokens [B, M] where ``valid`` [B, M] bool marks each row's real tokens.

        Returns float32 logits [B, keep, V] of the block's last ``keep`` columns.
        """
        return self.append_features(tokens, valid, keep, ())[0]

    def append_features(self, tokens: torch.Tensor, valid: torch.Tensor, keep: int, layers: tuple[int, ...]
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``append``, also returning the residual stream at the inputs of ``layers`` for every column of
        the block, concatenated: [B, M, len(layers)·H] float32 (None without layers)."""
        offsets = valid.long().cumsum(dim=1) - 1  # [B, M]: index of each token among the row's new ones
        position_ids = self.lengths[:, None] + offsets.clamp_min(0)  # [B, M]
        mask = torch.cat([self.mask, valid.long()], dim=1)  # [B, L + M]
        if bool(mask.all()):  # no holes: positions follow the cache length, as in a plain forward
            logits, features = hf_compat.forward(self.model, tokens, self.cache, keep, feature_layers=layers)
        else:
            logits, features = hf_compat.forward(self.model, tokens, self.cache, keep, mask, position_ids, layers)
        self.mask = mask
        self.lengths = self.lengths + valid.long().sum(dim=1)
        return logits, features

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep only the first ``lengths`` [B] tokens of each row; crop columns no row uses any more."""
        kept = (self.mask.cumsum(dim=1) <= lengths[:, None]) & self.mask.bool()  # [B, L]
        self.mask = kept.long()
        self.lengths = torch.minimum(self.lengths, lengths)
        used = kept.any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else 0
        if width < self.mask.shape[1]:
            hf_compat.rollback(self.cache, width)
            self.mask = self.mask[:, :width]

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` ([b] long indices), dropping the others (finished requests)."""
        hf_compat.select_rows(self.cache, rows.to(self.model.device))
        self.mask, self.lengths = self.mask[rows], self.lengths[rows]


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
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        tokens[i, : r.shape[0]], valid[i, : r.shape[0]] = r, True
    return tokens, valid
