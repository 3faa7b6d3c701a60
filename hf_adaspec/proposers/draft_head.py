"""Draft-head drafting: an EAGLE-3 head (``models.eagle3``) proposes from the target's own features.

The target's forwards (prefill and every verification) return its features at the positions they
confirm (``commit(..., features=...)``); the head keeps them until it next drafts. Drafting for a batch:
the first column ingests every row's pending entries at once — (x_p, g_{p−1}) for each position p the
target confirmed since, left-padded so each row's last entry lands in the last column — and its last
output gives the first token; each later column feeds the token just drafted with the head's own output
(EAGLE-3's training-time test). Only entries built on the target's features are kept: ``commit`` rolls
the head back to them (a drafted token, even when accepted, is ingested again with the target's feature).
q is the head's distribution mapped onto the target's vocabulary (zero off its draft vocabulary), so
verification against the full p stays lossless. Notation: p = target, q = draft.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backend.ragged import left_pad
from ..models.eagle3 import Eagle3Head, HeadKV
from .base import DraftOffer, Proposals, Rows, StopRule
from .chain import Sampler, draft_chain


class DraftHeadProposer:
    """Drafts with an EAGLE-3 head for all rows; its cache holds only entries built on target features."""

    name = "draft_head"

    def __init__(
        self,
        head: Eagle3Head,
        batch: int,
        cache: HeadKV,
        logits_processor,
        do_sample: bool,
        pad_token_id: int,
        eos_token_ids: tuple[int, ...] = (),
        generator: torch.Generator | None = None,
    ) -> None:
        """``cache``: where the head's entries for ``batch`` rows live (``backend.caches.open_head_cache``: a
        ``HeadCache``, or an arena whose drafted columns replay a recording), empty."""
        self.head, self.pad, self.cache = head, pad_token_id, cache
        self.sampler = Sampler(logits_processor, do_sample, torch.tensor(eos_token_ids, dtype=torch.long), generator)
        width = 3 * head.config.target_hidden_size
        self.pending = [torch.zeros(0, width) for _ in range(batch)]  # per row [m_i, 3·H_t]: features not ingested
        self.entries = torch.zeros(batch, dtype=torch.long)  # per row: entries built on target features

    def offer(self, rows: Rows, k_max: int) -> DraftOffer:
        """k_max tokens for every row, no evidence before drafting, and the pending entries beyond the 1–2
        a step confirms as catch-up columns (the prompt's features, or a run of steps it sat out)."""
        b = len(rows.views)
        return DraftOffer((k_max,) * b, (0,) * b, max(0, max(int(p.shape[0]) for p in self.pending) - 2))

    @torch.no_grad()
    def propose(self, rows: Rows, offer: DraftOffer, ks: Sequence[int], stop: StopRule | None = None) -> Proposals:
        """``chain.draft_chain`` over the head: column 0 ingests each row's pending entries (the tokens at
        the positions after its features: row i's tokens entries+1 .. entries+m_i), later columns feed the
        drafted token with the head's previous output."""
        b = len(rows.views)
        tokens, valid = left_pad(
            [
                rows.tokens(i)[int(self.entries[i]) + 1 : int(self.entries[i]) + 1 + self.pending[i].shape[0]]
                for i in range(b)
            ],
            self.pad,
        )  # [b, m]
        features = torch.zeros(b, tokens.shape[1], self.pending[0].shape[1])
        for i, p in enumerate(self.pending):
            if p.shape[0]:
                features[i, tokens.shape[1] - p.shape[0] :] = p
        self.entries, self.pending = self.entries + valid.long().sum(dim=1), [p[:0] for p in self.pending]
        last: list[torch.Tensor] = []

        def column(j: int, previous: torch.Tensor | None) -> torch.Tensor:
            if previous is None:
                out = self.head.step(tokens, self.head.fuse(features), valid, self.cache)  # [b, m, H]
                logits = self.head.logits(out[:, -1])  # [b, V]
            else:
                out, logits = self.cache.draft_column(self.head, previous[:, None], last[-1][:, None])  # [b, 1, H]
            last.append(out[:, -1])
            return logits

        return draft_chain(column, rows.views, ks, self.sampler, stop)

    def commit(
        self, lengths: torch.Tensor, keep: torch.Tensor | None = None, features: list[torch.Tensor] | None = None
    ) -> None:
        """Drop the drafted entries, queue the target's ``features`` of the confirmed positions (per row
        [c_i, 3·H_t]; ``lengths`` are not needed: the features say what was confirmed), then keep rows ``keep``.

        Raises ValueError when the run records no features (a head needs the target's)."""
        if features is None:
            raise ValueError("a draft head needs the target's features: build its run with feature_layers")
        self.cache.rollback(self.entries)
        self.pending = [torch.cat([p, f.float()]) for p, f in zip(self.pending, features, strict=True)]
        if keep is not None:
            self.cache.select(keep)
            self.entries = self.entries[keep]
            self.pending = [self.pending[int(i)] for i in keep]
