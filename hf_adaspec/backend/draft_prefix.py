"""Draft prefix reuse: the draft model's KV cache from a recent request seeds the next request's, so the
draft's prompt catch-up skips the tokens the two share.

A draft model must ingest the whole prompt before its first proposal (its catch-up), and a short
answer cannot earn that back: on this CPU the 0.5B draft ingests about 3 ms per prompt token, and the
answers of Spec-Bench's extraction, translation and qa prompts are 8–38 tokens. Yet requests share
tokens: every chat-templated request opens with the same system turn (Qwen2.5: 24 tokens, half of a
45-token translation prompt), and a multi-turn conversation resends its whole history.
``DraftPrefixStore`` keeps, per draft model, the token ids and the draft's KV cache of the last
``size`` requests that extended it; ``seed`` returns a copy of the cache cropped to the longest common
prefix with a new prompt (prefix caching, as vLLM's automatic prefix caching, here for the draft only).
The target's cache is not reused: plain decoding, the baseline, ingests the whole prompt too.
Lossless by construction: the draft only proposes, and the target verifies every token. A position's
keys and values depend only on the tokens before it, so a reused prefix holds what a fresh prefill
would (up to the last bits of a different forward shape).
"""

from __future__ import annotations

import weakref
from collections import deque
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
    """A draft KV cache holding the first ``length`` tokens of the prompt it was taken for (0: a new,
    empty cache)."""

    cache: object
    length: int


@dataclass(frozen=True)
class _Entry:
    model: weakref.ref
    tokens: torch.Tensor  # [L] long: what ``cache`` holds, in order
    cache: object


class DraftPrefixStore:
    """The draft's KV caches of the last ``size`` requests (per draft model), to seed new requests."""

    def __init__(self, size: int = 4) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.entries: deque[_Entry] = deque(maxlen=size)

    def seed(self, model: torch.nn.Module, prompt: torch.Tensor) -> PrefixSeed:
        """A fresh cache for ``model`` holding the longest prefix of ``prompt`` ([1, T] long) that a stored
        request of the same model shares, a copy (the stored one is never changed); empty if none does."""
        tokens = prompt[0].cpu()
        best, length = None, 0
        for entry in self.entries:
            if entry.model() is model:
                shared = common_prefix_length(entry.tokens, tokens)
                if shared > length:
                    best, length = entry, shared
        if best is None:
            return PrefixSeed(hf_compat.new_cache(model), 0)
        return PrefixSeed(hf_compat.copy_cache(best.cache, length), length)

    def remember(self, model: torch.nn.Module, sequence: torch.Tensor, cache: object, seeded: int) -> None:
        """Keep ``cache`` (the store takes it: do not use it after) with the tokens it holds, the first
        positions of ``sequence`` ([1, T + new] long), when it grew past the ``seeded`` length it started
        with; the oldest entry gives way."""
        length = hf_compat.cache_length(cache)
        if length > seeded:
            self.entries.append(_Entry(weakref.ref(model), sequence[0, :length].cpu().clone(), cache))
