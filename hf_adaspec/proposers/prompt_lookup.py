"""Prompt lookup drafting: copy the continuation of the latest earlier occurrence of the last n-gram.

No forward pass, so a proposal costs ~nothing; its quality depends on how repetitive the text is
(high for code edits and summaries, low for open QA). Each row searches its own prompt and output.
Saxena 2023, "Prompt Lookup Decoding".
"""

from __future__ import annotations

import torch

from .base import CostlessDrafter, DraftOffer, Rows

MATCH_CAP = 32  # match lengths are counted up to this many tokens


def find_match(tokens: torch.Tensor, max_ngram: int, min_ngram: int, k_max: int) -> tuple[torch.Tensor, int]:
    """The tokens that followed the most recent earlier match of the sequence's last n-gram, and the match
    length m: how many tokens before that continuation equal the sequence's last tokens (≥ n, ≤ MATCH_CAP).

    Tries n = max_ngram down to min_ngram and takes the first hit, at most k_max tokens. tokens: [T] long
    → ([k'] long with 0 ≤ k' ≤ k_max, m; m = 0 when nothing matched).
    """
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = tokens[: length - 1].unfold(0, n, 1)  # [T-n, n]: every n-gram that has a successor
        hits = (windows == tokens[length - n :]).all(dim=-1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n
            span = min(MATCH_CAP, start)
            same = (tokens[start - span : start].flip(0) == tokens[length - span :].flip(0)).int()  # [span]
            return tokens[start : min(start + k_max, length)], int(same.cumprod(0).sum())
    return tokens[:0], 0


def find_continuation(tokens: torch.Tensor, max_ngram: int, min_ngram: int, k_max: int) -> torch.Tensor:
    """``find_match``'s continuation alone. tokens: [T] long → [k'] long with 0 ≤ k' ≤ k_max."""
    return find_match(tokens, max_ngram, min_ngram, k_max)[0]


class PromptLookupProposer(CostlessDrafter):
    """Per-row n-gram lookup over prompt + output so far; q=None (deterministic drafter)."""

    name = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        """Raises ValueError unless 1 <= min_ngram <= max_ngram."""
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def offer(self, rows: Rows, k_max: int) -> DraftOffer:
        """Per row the continuation of its last n-gram ([u_i] long, u_i ≤ k_max; empty if none) and, as
        evidence, its match length."""
        found = [find_match(rows.tokens(i), self.max_ngram, self.min_ngram, k_max) for i in range(len(rows.views))]
        return DraftOffer(tuple(int(f.shape[0]) for f, _ in found), tuple(m for _, m in found),
                          tokens=tuple(f for f, _ in found))
