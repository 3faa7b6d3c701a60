"""Draft-model drafting: a small model with the target's vocabulary proposes k tokens autoregressively.

Notation: q = draft distribution. The draft keeps its own KV cache. It lazily catches up on tokens it
has not seen (the previous step's bonus/correction token, or many tokens after a run of plain steps)
in one forward, then drafts one token per forward, reporting q(x_u) of each drafted token; an
optional ``stop`` callable may end the proposal after any token. Rolled back to the confirmed prefix
after every verification. It may start from a cache that already holds a prefix of the prompt, reused
from an earlier request (``draft_prefix``).

A long catch-up may run on a second copy of the draft, ``catchup_model``: the same weights, dense. On
a CPU a one-token draft forward is bound by reading the weights, so NF4 wins there, while a forward
over hundreds of tokens is bound by arithmetic, where bitsandbytes' NF4 path costs more per token than
a dense bf16 matmul (0.5B draft, 24 cached tokens, median of 3: 300 new tokens 921 ms NF4 vs 698 ms
bf16, 160: 507 vs 393, 64: 212 vs 200, 16: 72 vs 107; ``python benchmarks/catchup_model.py``). So
a pending chunk of at least ``CATCHUP_MODEL_MIN_TOKENS`` goes through ``catchup_model``; both models
write the same KV cache. Lossless: the draft only proposes, and under sampling q is the distribution
the token was drawn from, whichever copy computed it.
"""

from __future__ import annotations

import torch

from collections.abc import Callable

from .. import hf_compat
from .base import Proposal

CATCHUP_MODEL_MIN_TOKENS = 64  # pending tokens from which the dense copy ingests faster (see above)


def check_catchup_model(draft: torch.nn.Module, catchup_model: torch.nn.Module) -> None:
    """Raise ValueError unless ``catchup_model`` can write ``draft``'s KV cache: the same vocabulary,
    layers, KV heads and head size, and activations of the same dtype on the same device."""
    def shape(model: torch.nn.Module) -> tuple:
        cfg = model.config.get_text_config()
        heads = cfg.num_attention_heads
        return (hf_compat.vocab_size(model), cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads,
                getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)

    if shape(draft) != shape(catchup_model):
        raise ValueError(f"assistant_catchup_model must be a copy of the draft model (vocabulary, layers, KV heads, "
                         f"head size {shape(draft)}), got {shape(catchup_model)}: load the same draft with "
                         "quantization='none'")
    a, b = draft.get_input_embeddings().weight, catchup_model.get_input_embeddings().weight
    if (a.dtype, a.device) != (b.dtype, b.device):
        raise ValueError(f"assistant_catchup_model computes in {b.dtype} on {b.device}, the draft in {a.dtype} on "
                         f"{a.device}; their KV caches must match: load it with the draft's dtype and device")


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
        catchup_model: torch.nn.Module | None = None,
    ) -> None:
        """``cache``: a draft KV cache already holding a prefix of the prompt (``draft_prefix``); None: empty.
        ``catchup_model``: a dense copy of ``model`` that ingests pending chunks of at least
        ``CATCHUP_MODEL_MIN_TOKENS`` (see the module docstring); None: ``model`` ingests everything.

        Raises:
            ValueError: ``catchup_model`` cannot write ``model``'s cache (``check_catchup_model``).
        """
        if catchup_model is not None:
            check_catchup_model(model, catchup_model)
        self.model, self.catchup_model = model, catchup_model
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
            model = self.model
            if self.catchup_model is not None and pending.shape[1] >= CATCHUP_MODEL_MIN_TOKENS:
                model = self.catchup_model
            logits = hf_compat.forward_logits(model, pending, self.cache, keep=1)[:, -1]  # [1, V]
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
