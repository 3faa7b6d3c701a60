"""Prompt lookup drafting: copy the continuation of the latest earlier occurrence of the last n-gram.

No forward pass, so a proposal costs ~nothing; its quality depends on how repetitive the text is
(high for code edits and summaries, low for open QA). Saxena 2023, "Prompt Lookup Decoding".
"""

from __future__ import annotations

import torch

from .base import Proposal

# A new pair's α for prompt lookup until it has recorded acceptance rates (``AcceptanceMemory.prior_for``):
# 0.37 is the upper quartile of its per-request acceptance (accepted / drafted tokens) on 52 Spec-Bench
# prompts, median 0.29 (``adaptive-lookup`` in benchmarks/results/spec_bench_4pc_64tok_coldstart.json).
# The draft model's start, the upper quartile of Beta(0.6·4, 0.4·4) ≈ 0.78, is twice that: as prompt
# lookup's start it had the hybrids verify lookup tokens that were rarely accepted (README, Benchmark).
LOOKUP_START_ALPHA = 0.37


def find_continuation(tokens: torch.Tensor, max_ngram: int, min_ngram: int, k_max: int) -> torch.Tensor:
    """Tokens that followed the most recent earlier match of the sequence's last n-gram.

    Tries n = max_ngram down to min_ngram and returns the first hit's continuation, at most k_max
    tokens. tokens: [T] long → [k'] long with 0 ≤ k' ≤ k_max.
    """
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = tokens[: length - 1].unfold(0, n, 1)  # [T-n, n]: every n-gram that has a successor
        hits = (windows == tokens[length - n :]).all(dim=-1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start : min(start + k_max, length)]
    return tokens[:0]


def check_ngram_sizes(max_ngram: int, min_ngram: int) -> tuple[int, int]:
    """(max_ngram, min_ngram) if 1 <= min_ngram <= max_ngram.

    Raises:
        ValueError: otherwise.
    """
    if not 1 <= min_ngram <= max_ngram:
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
    return max_ngram, min_ngram


class PromptLookupProposer:
    """Drafts by n-gram lookup over prompt + output so far (batch size 1)."""

    name = "prompt_lookup"
    costless = True  # no forward pass and no state: its unverified proposals can be scored (``hindsight``)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = check_ngram_sizes(max_ngram, min_ngram)
        self._cached: tuple[int, int, torch.Tensor] | None = None  # (length, k searched, continuation)

    def _lookup(self, tokens: torch.Tensor, k_max: int) -> torch.Tensor:
        """Continuation of at most k_max tokens; one search per step serves available() and propose()."""
        length = tokens.shape[1]
        if self._cached is None or self._cached[0] != length or self._cached[1] < k_max:
            self._cached = (length, k_max, find_continuation(tokens[0], self.max_ngram, self.min_ngram, k_max))
        return self._cached[2][:k_max]

    def available(self, tokens: torch.Tensor, k_max: int) -> int:
        """Length of the continuation found (0 when the last n-gram never occurred before)."""
        return min(int(self._lookup(tokens, k_max).shape[0]), k_max)

    def catchup_tokens(self, tokens: torch.Tensor) -> int:
        """No model state to catch up."""
        return 0

    def propose(self, tokens: torch.Tensor, k: int) -> Proposal:
        """The first k tokens of the found continuation, [1, k]; q=None (deterministic drafter)."""
        return Proposal(tokens=self._lookup(tokens, k)[:k][None, :])

    def rollback(self, length: int) -> None:
        """Stateless apart from the per-length lookup cache."""
        self._cached = None
