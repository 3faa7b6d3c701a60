"""Draft-model drafting: a small model with the target's vocabulary proposes for every row at once.

Notation: q = draft distribution. The draft keeps its own ``RaggedCache``. Each proposal first feeds
every row the tokens it has not seen (the previous step's bonus/correction token, or many tokens after
a run of plain steps; left-padded, so each row's last token lands in the last column), then drafts one
token per row per forward, up to max_i k_i times (fewer when a stop rule ends it, or every row has its
tokens); a row keeps its first k_i tokens, cut after an EOS. Rolled back per row to the confirmed
prefix after verification. At batch size 1 it may start from a cache that already holds a prefix of
the prompt, reused from an earlier request (``backend.draft_prefix``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backend.ragged import KVCache, left_pad
from .base import DraftOffer, Proposal, Rows, StopRule


class DraftModelProposer:
    """Drafts with a small causal LM for all rows; q are its processed probabilities when sampling."""

    name = "draft_model"

    def __init__(self, cache: KVCache, logits_processor, do_sample: bool, pad_token_id: int,
                 eos_token_ids: tuple[int, ...] = (), generator: torch.Generator | None = None) -> None:
        """``cache``: the draft model's cache for the batch (a ``RaggedCache`` of the model, possibly already
        holding a prefix of each prompt; the replay passes one that answers from traces)."""
        self.cache, self.logits_processor, self.do_sample = cache, logits_processor, do_sample
        self.pad, self.eos, self.generator = pad_token_id, torch.tensor(eos_token_ids, dtype=torch.long), generator

    def offer(self, rows: Rows, k_max: int) -> DraftOffer:
        """k_max tokens for every row, no evidence before drafting (the confidences come with the tokens),
        and the columns of unseen tokens beyond the 1–2 every step feeds (prompts, runs of plain steps)."""
        b = len(rows.views)
        return DraftOffer((k_max,) * b, (0,) * b, max(0, int((rows.lengths - self.cache.lengths).max()) - 2))

    def _next(self, views: list[torch.Tensor], logits: torch.Tensor, confident: bool) -> tuple[
            torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One draft token per row from logits [b, V] → tokens [b], q [b, V] (None when greedy) and, if
        ``confident``, the tokens' q(x) [b] under the processed scores (else None)."""
        scores = logits
        if self.logits_processor:  # processors see each row's own tokens, so they run row by row
            scores = torch.cat([self.logits_processor(v[None], logits[i : i + 1]) for i, v in enumerate(views)])
        if not self.do_sample:
            if not confident:
                return scores.argmax(dim=-1), None, None
            f = scores.float()
            shifted = f - f.max(dim=-1, keepdim=True).values
            return scores.argmax(dim=-1), None, 1.0 / shifted.exp().sum(dim=-1)  # softmax at the argmax
        q = torch.softmax(scores, dim=-1)  # [b, V]
        token = torch.multinomial(q, 1, generator=self.generator)  # [b, 1]
        return token.squeeze(1), q, q.gather(1, token).squeeze(1) if confident else None

    @torch.no_grad()
    def propose(self, rows: Rows, offer: DraftOffer, ks: Sequence[int], stop: StopRule | None = None
                ) -> list[Proposal]:
        """Row i gets up to ks[i] tokens ([1, k_i']) cut just after an EOS and, when sampling, q [1, k_i', V].
        With a ``stop`` rule, asked after each column, drafting may end early and every proposal carries
        its tokens' confidences q(x_u) (without one they are left empty: a softmax per column saved)."""
        b = len(rows.views)
        seen = self.cache.lengths.tolist()
        tokens, valid = left_pad([rows.tokens(i)[seen[i] :] for i in range(b)], self.pad)  # [b, m ≥ 1]
        views, kept = list(rows.views), list(ks)  # row i keeps its first kept[i] tokens
        drafted, probs, confs = [], [], []
        for j in range(max(ks)):
            logits = self.cache.append(tokens, valid, keep=1)[:, -1].cpu()  # [b, V]
            token, q, conf = self._next(views, logits, stop is not None)  # [b], [b, V], [b]
            drafted.append(token)
            probs.append(q)
            confs.append(conf)
            eos = torch.isin(token, self.eos).tolist() if self.eos.numel() else [False] * b
            kept = [j + 1 if k > j and hit else k for k, hit in zip(kept, eos, strict=True)]
            if self.logits_processor:
                views = [torch.cat([v, token[i : i + 1]]) for i, v in enumerate(views)]
            tokens, valid = token[:, None], torch.ones(b, 1, dtype=torch.bool)
            growing = [k > j + 1 for k in kept]
            if not any(growing):
                break
            if stop is not None:
                table = torch.stack(confs, dim=1).tolist()  # [b, j+1]
                if stop(j + 1, [tuple(r[:k]) for r, k in zip(table, kept)], growing):
                    break
        out = torch.stack(drafted, dim=1)  # [b, J]
        table = torch.stack(confs, dim=1).tolist() if stop is not None else [[] for _ in range(b)]
        kept = [min(k, out.shape[1]) for k in kept]
        return [self._row(out[i], [q[i] for q in probs] if self.do_sample else None, kept[i], table[i])
                for i in range(b)]

    @staticmethod
    def _row(tokens: torch.Tensor, q: list[torch.Tensor] | None, k: int, confidences: list[float]) -> Proposal:
        """Row proposal: the first k tokens [1, k], their confidences and q [1, k, V] (sampling)."""
        q_row = torch.stack(q[:k])[None] if q is not None and k else None  # [1, k, V]
        return Proposal(tokens=tokens[:k][None, :], q=q_row, confidences=tuple(confidences[:k]))

    def commit(self, lengths: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """Keep only the first lengths[i] tokens of row i in the draft cache, then only rows ``keep``."""
        self.cache.rollback(lengths)
        if keep is not None:
            self.cache.select(keep)
