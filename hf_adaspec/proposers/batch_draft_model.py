"""Draft-model drafting for a static batch: the draft proposes for every active row at once.

The draft keeps a ``RaggedCache``. Each proposal first feeds every row the tokens it has not seen
(left-padded, so each row's last token lands in the last column), then drafts one token per row per
forward, max_i k_i times; a row keeps its first k_i tokens, cut after an EOS. Rolled back per row to
the confirmed prefix after verification.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ragged import RaggedCache, left_pad
from .base import Proposal
from .batch_base import BatchRows


class BatchDraftModelProposer:
    """Drafts with a small causal LM for all rows; q are its processed probabilities when sampling."""

    name = "draft_model"

    def __init__(
        self,
        model: torch.nn.Module,
        batch: int,
        logits_processor,
        do_sample: bool,
        pad_token_id: int,
        eos_token_ids: tuple[int, ...] = (),
        generator: torch.Generator | None = None,
    ) -> None:
        self.model, self.logits_processor, self.do_sample = model, logits_processor, do_sample
        self.pad, self.eos, self.generator = pad_token_id, torch.tensor(eos_token_ids, dtype=torch.long), generator
        self.cache = RaggedCache(model, batch)

    def available(self, rows: BatchRows, k_max: int) -> list[int]:
        """A draft model can always offer k_max tokens per row."""
        return [k_max] * len(rows.views)

    def catchup_tokens(self, rows: BatchRows) -> int:
        """Columns of unseen tokens beyond the 1–2 every step feeds (prompts, runs of plain steps)."""
        return max(0, int((rows.lengths - self.cache.lengths).max()) - 2)

    def _next(self, views: list[torch.Tensor], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token per row from logits [b, V] → tokens [b], q [b, V] (None when greedy)."""
        scores = logits
        if self.logits_processor:  # processors see each row's own tokens, so they run row by row
            scores = torch.cat([self.logits_processor(v[None], logits[i : i + 1]) for i, v in enumerate(views)])
        if not self.do_sample:
            return scores.argmax(dim=-1), None
        q = torch.softmax(scores, dim=-1)  # [b, V]
        return torch.multinomial(q, 1, generator=self.generator).squeeze(1), q

    @torch.no_grad()
    def propose(self, rows: BatchRows, ks: Sequence[int]) -> list[Proposal]:
        """Row i gets up to ks[i] tokens ([1, k_i']) and, when sampling, q [1, k_i', V]."""
        b, width = len(rows.views), max(ks)
        seen = self.cache.lengths.tolist()
        tokens, valid = left_pad([rows.tokens(i)[seen[i] :] for i in range(b)], self.pad)  # [b, m ≥ 1]
        views = list(rows.views)
        drafted, probs = [], []
        for _ in range(width):
            logits = self.cache.append(tokens, valid, keep=1)[:, -1].cpu()  # [b, V]
            token, q = self._next(views, logits)  # [b], [b, V]
            drafted.append(token)
            probs.append(q)
            if self.logits_processor:
                views = [torch.cat([v, token[i : i + 1]]) for i, v in enumerate(views)]
            tokens, valid = token[:, None], torch.ones(b, 1, dtype=torch.bool)
        out = torch.stack(drafted, dim=1)  # [b, width]
        return [self._row(out[i], [q[i] for q in probs] if self.do_sample else None, ks[i]) for i in range(b)]

    def _row(self, tokens: torch.Tensor, q: list[torch.Tensor] | None, k: int) -> Proposal:
        """Row proposal: the first k tokens [k], cut just after the first EOS; q rows alike."""
        if self.eos.numel():
            hits = torch.isin(tokens[:k], self.eos).nonzero()
            k = int(hits[0]) + 1 if hits.numel() else k
        q_row = torch.stack(q[:k])[None] if q is not None and k else None  # [1, k, V]
        return Proposal(tokens=tokens[:k][None, :], q=q_row)

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep only the first lengths[i] tokens of row i in the draft cache."""
        self.cache.rollback(lengths)

    def select(self, rows: torch.Tensor) -> None:
        """Drop finished rows from the draft cache."""
        self.cache.select(rows)
