"""Prompt lookup drafting: copy the continuation of the latest earlier occurrence of the last n-gram.

No forward pass, so a proposal costs ~nothing; its quality depends on how repetitive the text is
(high for code edits and summaries, low for open QA). Each row searches its own prompt and output.
Saxena 2023, "Prompt Lookup Decoding".
"""

from __future__ import annotations

import numpy as np
import torch

from .base import CostlessDrafter, DraftOffer, Rows

MATCH_CAP = 32  # match lengths are counted up to this many tokens


def find_match(tokens: torch.Tensor, max_ngram: int, min_ngram: int, k_max: int) -> tuple[torch.Tensor, int]:
    """The tokens that followed the most recent earlier match of the sequence's last n-gram, and the match
    length m: how many tokens before that continuation equal the sequence's last tokens (≥ n, ≤ MATCH_CAP).

    Tries n = max_ngram down to min_ngram and takes the first hit, at most k_max tokens. tokens: [T] long
    → ([k'] long with 0 ≤ k' ≤ k_max, m; m = 0 when nothing matched). One pass: every earlier position of
    the last token is a candidate n-gram end, and how far each one's match reaches back says for which n
    it is a hit (the largest n with a hit wins, then the most recent end).
    """
    ids = tokens.numpy()  # [T], the same memory
    length = ids.shape[0]
    ends = (ids[: length - 1] == ids[length - 1]).nonzero()[0] if length > 1 else np.empty(0, dtype=np.int64)
    if not ends.size:
        return tokens[:0], 0
    back = np.arange(max(MATCH_CAP, max_ngram))  # [W]: how far back of each end (and of the last token) a pair lies
    at = ends[:, None] - back[None, :]  # [E, W] positions before and at each candidate end
    same = (at >= 0) & (ids[np.maximum(at, 0)] == ids[np.maximum(length - 1 - back, 0)][None, :])  # [E, W]
    reach = np.logical_and.accumulate(same, axis=1).sum(axis=1)  # [E]: the match length ending at each
    n = min(max_ngram, int(reach.max()))
    if n < min_ngram:
        return tokens[:0], 0
    hit = int((reach >= n).nonzero()[0][-1])  # the most recent end whose match reaches n tokens back
    start = int(ends[hit]) + 1
    return tokens[start : min(start + k_max, length)], min(MATCH_CAP, int(reach[hit]))


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
        return DraftOffer(
            tuple(int(f.shape[0]) for f, _ in found), tuple(m for _, m in found), tokens=tuple(f for f, _ in found)
        )
