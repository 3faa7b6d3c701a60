"""Draft prefix reuse: the draft model's KV cache from a recent request seeds the next request's, so the
draft's prompt catch-up skips the tokens the two share.

A draft model must ingest the whole prompt before its first proposal (its catch-up), which a short
answer cannot earn back. Yet requests share tokens: every chat-templated request opens with the same
system turn, and a multi-turn conversation resends its whole history. ``DraftPrefixStore`` keeps, per
draft model, the token ids and the draft's KV cache of the last ``size`` requests that extended it;
``seed`` returns a copy of the cache cropped to the longest common prefix with a new prompt (prefix
caching, as vLLM's automatic prefix caching, here for the draft only). A store may keep token ids
without caches (the replay's draft answers from traces): its seeds then give the length alone.
The target's cache is not reused: plain decoding, the baseline, ingests the whole prompt too.
Lossless by construction: the draft only proposes, and the target verifies every token. A position's
keys and values depend only on the tokens before it, so a reused prefix holds what a fresh prefill
would (up to the last bits of a different forward shape).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import hf_compat


def common_prefix_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of leading tokens two 1-D id tensors share."""
    n = min(a.shape[0], b.shape[0])
    if n == 0:
        return 0
    return int((a[:n] == b[:n]).int().cumprod(0).sum())


@dataclass(frozen=True)
class PrefixSeed:
    """The first ``length`` tokens of a prompt, already held by ``cache`` (a transformers cache, a copy the
    caller may extend; None when the store keeps token ids only, as the replay's does, or for length 0)."""

    cache: object | None
    length: int


@dataclass(frozen=True)
class _Entry:
    model: weakref.ref
    tokens: torch.Tensor  # [L] long: what ``cache`` holds, in order
    cache: object | None


class DraftPrefixStore:
    """The draft's KV caches of the last ``size`` requests (per draft model), to seed new requests."""

    def __init__(self, size: int = 4) -> None:
        """Raises ValueError for size < 1."""
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.entries: deque[_Entry] = deque(maxlen=size)

    def seed(self, model: object, prompt: torch.Tensor) -> PrefixSeed:
        """The longest prefix of ``prompt`` ([T] long) that a stored request of the same draft ``model``
        shares, with a copy of its cache cropped to it (the stored one is never changed); length 0 if none."""
        tokens = prompt.cpu()
        best, length = None, 0
        for entry in self.entries:
            if entry.model() is model:
                shared = common_prefix_length(entry.tokens, tokens)
                if shared > length:
                    best, length = entry, shared
        if best is None or best.cache is None:
            return PrefixSeed(None, length)
        return PrefixSeed(hf_compat.copy_cache(best.cache, length), length)

    def mapped(self, encode: Callable[[torch.Tensor], torch.Tensor]) -> DraftPrefixStore:
        """A copy holding the same entries' token ids ``encode``d ([L] long → [L] long) and no caches, to seed
        by prefix length alone (the replay's requests each use ids of their own)."""
        out = DraftPrefixStore(self.entries.maxlen or 1)
        out.entries.extend(_Entry(e.model, encode(e.tokens), None) for e in self.entries)
        return out

    def remember(self, model: object, tokens: Sequence[int], held: int, seeded: int, cache: object | None) -> None:
        """Keep a finished request's draft ``cache`` (the store takes it: do not use it after; None: keep the
        token ids only) holding the first ``held`` of ``tokens`` (prompt + output), when it grew past the
        ``seeded`` length it started with; the oldest entry gives way."""
        if held > seeded:
            self.entries.append(_Entry(weakref.ref(model), torch.tensor(list(tokens[:held]), dtype=torch.long), cache))
