"""Draft-model drafting: a small model with the target's vocabulary proposes k tokens autoregressively.

Notation: q = draft distribution. The draft keeps its own KV cache. It lazily catches up on tokens it
has not seen (the previous step's bonus/correction token, or many tokens after a run of plain steps)
in one forward, then drafts one token per forward, reporting q(x_u) of each drafted token; an
optional ``stop`` callable may end the proposal after any token. Rolled back to the confirmed prefix
after every verification. It may start from a cache that already holds a prefix of the prompt, reused
from an earlier request (``draft_prefix``).
"""

from __future__ import annotations

import torch

from collections.abc import Callable

from .. import hf_compat
from .base import Proposal


class DraftModelProposer:
    """Drafts with a small causal LM; q are its processed probabilities (sampling) or argmax (greedy)."""

    name = "draft_model"

    def __init__(
        self,
        model: torch.nn.Module,
        logits_processor,
        do_sample: bool,
        eos_token_ids: tuple[int, ...] = (),
        generator: torch.Generator | None = None,
        cache: object | None = None,
    ) -> None:
        """``cache``: a draft KV cache already holding a prefix of the prompt (``draft_prefix``); None: empty."""
        self.model = model
        self.logits_processor = logits_processor
        self.do_sample = do_sample
        self.eos = torch.tensor(eos_token_ids, dtype=torch.long)
        self.generator = generator
        self.cache = cache if cache is not None else hf_compat.new_cache(model)

    def available(self, tokens: torch.Tensor, k_max: int) -> int:
        """A draft model can always offer k_max tokens."""
        return k_max

    def catchup_tokens(self, tokens: torch.Tensor) -> int:
        """Tokens not yet in the draft cache beyond the 1–2 every step feeds (prompt, plain-step runs)."""
        return max(0, tokens.shape[1] - hf_compat.cache_length(self.cache) - 2)

    @torch.no_grad()
    def propose(
        self, tokens: torch.Tensor, k: int, stop: Callable[[int, tuple[float, ...]], bool] | None = None
    ) -> Proposal:
        """Draft up to k tokens, stopping after an EOS or when ``stop(j, confidences)`` says so (asked
        after each drafted token; j = drafted so far). tokens: [1, T] → Proposal [1, k'], q [1, k', V]
        when sampling, and confidences q(x_u): of the argmax under the processed scores (greedy) or of
        the sampled token (sampling)."""
        context = tokens.to(self.model.device)
        pending = context[:, hf_compat.cache_length(self.cache) :]  # [1, m ≥ 1] not yet in the draft cache
        drafted, probs, confidences = [], [], []
        for _ in range(k):
            logits = hf_compat.forward_logits(self.model, pending, self.cache, keep=1)[:, -1]  # [1, V]
            scores = self.logits_processor(context, logits)  # [1, V]
            q = torch.softmax(scores, dim=-1)  # [1, V]
            if self.do_sample:
                token = torch.multinomial(q, 1, generator=self.generator)  # [1, 1]
                probs.append(q)
            else:
                token = scores.argmax(dim=-1, keepdim=True)  # [1, 1]
            drafted.append(token)
            confidences.append(float(q[0, token[0, 0]]))
            context = torch.cat([context, token], dim=1)
            pending = token
            if self.eos.numel() and bool(torch.isin(token, self.eos.to(token.device)).any()):
                break
            if stop is not None and len(drafted) < k and stop(len(drafted), tuple(confidences)):
                break
        q_all = torch.stack(probs, dim=1) if probs else None  # [1, k', V]
        return Proposal(torch.cat(drafted, dim=1).to(tokens.device), q_all, tuple(confidences))

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` positions of the draft cache."""
        hf_compat.rollback(self.cache, length)
