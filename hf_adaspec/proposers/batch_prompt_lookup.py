"""Prompt lookup for a static batch: each row searches its own prompt and output (Saxena 2023)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .base import Proposal
from .batch_base import BatchRows, BatchStopRule
from .prompt_lookup import check_ngram_sizes, find_continuation


class BatchPromptLookupProposer:
    """Per-row n-gram lookup; q=None (deterministic drafter). No state beyond the current step."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = check_ngram_sizes(max_ngram, min_ngram)
        self._found: list[torch.Tensor] = []

    def available(self, rows: BatchRows, k_max: int) -> list[int]:
        """Per row, the length of the continuation of its last n-gram (0 if none)."""
        self._found = [find_continuation(rows.tokens(i), self.max_ngram, self.min_ngram, k_max)
                       for i in range(len(rows.views))]
        return [int(f.shape[0]) for f in self._found]

    def catchup_tokens(self, rows: BatchRows) -> int:
        """No model state to catch up."""
        return 0

    def propose(self, rows: BatchRows, ks: Sequence[int], stop: BatchStopRule | None = None) -> list[Proposal]:
        """Row i: the first ks[i] tokens found by the last ``available`` call, [1, k_i]; ``stop`` is not
        asked (lookup has no confidences and its tokens cost nothing to draft)."""
        return [Proposal(tokens=f[:k][None, :]) for f, k in zip(self._found, ks, strict=True)]

    def rollback(self, lengths: torch.Tensor) -> None:
        """Stateless across steps."""
        self._found = []

    def select(self, rows: torch.Tensor) -> None:
        """Stateless across steps."""
        self._found = []
