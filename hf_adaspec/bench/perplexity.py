"""Perplexity scored the way llama.cpp's ``llama-perplexity`` scores it (tools/perplexity/perplexity.cpp).

The text's tokens are cut into non-overlapping chunks of n_ctx tokens (a tail that fills no chunk is dropped);
each chunk is one forward from an empty cache, its first token replaced by BOS where the vocabulary adds BOS
(Qwen2's does not), and only its second half is scored: for j in [n_ctx//2, n_ctx - 1), the negative
log-likelihood (nats) of token j+1 under the logits at position j, so n_ctx - 1 - n_ctx//2 tokens a chunk.
PPL = exp(mean NLL); its ± is llama.cpp's: PPL · sqrt((mean(NLL²) - mean(NLL)²) / (n - 1)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Perplexity:
    """exp(mean NLL) over ``tokens`` scored tokens, and its standard error (llama.cpp's "+/-")."""

    ppl: float
    err: float
    tokens: int


def chunks(tokens: Sequence[int], n_ctx: int, n_chunks: int | None = None, bos: int | None = None) -> list[list[int]]:
    """The first ``n_chunks`` (None: all) non-overlapping chunks of ``n_ctx`` tokens; ``bos`` (where the vocabulary
    adds one) replaces each chunk's first token. Raises ValueError: n_ctx < 4, or fewer than 2·n_ctx tokens
    (llama.cpp refuses those too)."""
    if n_ctx < 4:
        raise ValueError(f"n_ctx={n_ctx}: use at least 4 tokens a chunk")
    if len(tokens) < 2 * n_ctx:
        raise ValueError(
            f"{len(tokens)} tokens: perplexity with n_ctx={n_ctx} needs at least {2 * n_ctx}; "
            "pass a longer text or a smaller --n-ctx"
        )
    n = len(tokens) // n_ctx if n_chunks is None else min(n_chunks, len(tokens) // n_ctx)
    out = [list(tokens[i * n_ctx : (i + 1) * n_ctx]) for i in range(n)]
    if bos is not None:
        for c in out:
            c[0] = bos
    return out


def chunk_nll(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """NLL (nats, float64) of each scored token of one chunk: [n_ctx - 1 - n_ctx//2].

    ``tokens``: [n_ctx], the chunk as fed to the model. ``logits``: [L, V], the logits at the chunk's last L
    positions (the full [n_ctx, V], or only the scored half with L = n_ctx - n_ctx//2, as ``logits_to_keep`` gives).
    Raises ValueError: L too short to hold position n_ctx//2."""
    n_ctx = tokens.shape[0]
    first, offset = n_ctx // 2, n_ctx - logits.shape[0]
    if offset > first:
        raise ValueError(f"logits for the last {logits.shape[0]} positions; scoring needs the last {n_ctx - first}")
    logp = torch.log_softmax(logits[first - offset : n_ctx - 1 - offset].float(), dim=-1)  # [n, V]
    return -logp.gather(-1, tokens[first + 1 :].long().unsqueeze(-1)).squeeze(-1).double()  # [n]


def estimate(nll: torch.Tensor) -> Perplexity:
    """PPL and llama.cpp's standard error from per-token NLL [n] (n >= 2). Raises ValueError: fewer than 2."""
    n = nll.numel()
    if n < 2:
        raise ValueError(f"{n} scored tokens: the standard error needs at least 2")
    mean = nll.double().mean().item()
    var = max((nll.double() ** 2).mean().item() - mean * mean, 0.0)
    ppl = math.exp(mean)
    return Perplexity(ppl=ppl, err=ppl * math.sqrt(var / (n - 1)), tokens=n)
