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
from .base import DraftOffer, Proposals, Rows, StopRule
from .chain import Sampler, draft_chain


class DraftModelProposer:
    """Drafts with a small causal LM for all rows; q are its processed probabilities when sampling."""

    name = "draft_model"

    def __init__(
        self,
        cache: KVCache,
        logits_processor,
        do_sample: bool,
        pad_token_id: int,
        eos_token_ids: tuple[int, ...] = (),
        generator: torch.Generator | None = None,
        widths: tuple[int, int] | None = None,
    ) -> None:
        """``cache``: the draft model's cache for the batch (a ``RaggedCache`` of the model, possibly already
        holding a prefix of each prompt; the replay passes one that answers from traces). ``widths``: (the
        draft's vocabulary, the target's) when the draft's is narrower (the same tokenizer, the target's
        head padded): its logits are padded to the target's with −inf, and an id beyond its own (which it
        cannot embed, and never proposes) is fed to it as its last id; None: equal widths."""
        self.cache, self.pad, self.widths = cache, pad_token_id, widths
        self.sampler = Sampler(logits_processor, do_sample, torch.tensor(eos_token_ids, dtype=torch.long), generator)

    def offer(self, rows: Rows, k_max: int) -> DraftOffer:
        """k_max tokens for every row, no evidence before drafting (the confidences come with the tokens),
        and the columns of unseen tokens beyond the 1–2 every step feeds (prompts, runs of plain steps)."""
        b, seen = len(rows.views), self.cache.held()
        unseen = max(v.shape[0] - start - c for v, start, c in zip(rows.views, rows.starts, seen, strict=True))
        return DraftOffer((k_max,) * b, (0,) * b, max(0, unseen - 2))

    @torch.no_grad()
    def propose(self, rows: Rows, offer: DraftOffer, ks: Sequence[int], stop: StopRule | None = None) -> Proposals:
        """``chain.draft_chain`` over the draft model: the first column feeds every row the tokens it has not
        seen (left-padded, so each row's last token lands in the last column), each later one the token
        just drafted."""
        b = len(rows.views)
        seen = self.cache.held()
        fresh = [rows.tokens(i)[seen[i] :] for i in range(b)]
        same = all(t.shape[0] == fresh[0].shape[0] for t in fresh)  # no padding: valid None (every column real)
        unseen = (torch.stack(fresh), None) if same else left_pad(fresh, self.pad)  # [b, m ≥ 1] tokens, valid
        if self.widths is not None:
            unseen = (unseen[0].clamp_max(self.widths[0] - 1), unseen[1])

        def column(j: int, previous: torch.Tensor | None) -> torch.Tensor:
            tokens, valid = unseen if previous is None else (previous[:, None], None)  # None: every column real
            logits = self.cache.append(tokens, valid, keep=1)[:, -1]  # [b, V_draft] on the draft's device
            if self.widths is None:
                return logits
            return torch.nn.functional.pad(logits, (0, self.widths[1] - self.widths[0]), value=float("-inf"))

        return draft_chain(column, rows.views, ks, self.sampler, stop)

    def commit(
        self, lengths: torch.Tensor, keep: torch.Tensor | None = None, features: list[torch.Tensor] | None = None
    ) -> None:
        """Keep only the first lengths[i] tokens of row i in the draft cache, then only rows ``keep``
        (the target's ``features`` are not used)."""
        self.cache.rollback(lengths)
        if keep is not None:
            self.cache.select(keep)
