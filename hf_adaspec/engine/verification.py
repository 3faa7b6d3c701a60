"""Verification of a k-token proposal against the target: greedy and lossless speculative sampling.

Notation: p = target distribution, q = draft distribution (Leviathan et al. 2023; Chen et al. 2023).
Pure functions over tensors, batch-shaped: B rows ([B, ...]) verified at once, each row independently;
also the scores they verify against (logits processors applied position by position) and one token
chosen from scores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..kernels.argmax import argmax


@dataclass(frozen=True)
class Verification:
    """Outcome of verifying one proposal.

    num_accepted: [B] long, accepted draft tokens n ∈ {0..k}.
    next_token: [B] long, the token emitted after them: bonus (n = k) or correction (n < k).
    """

    num_accepted: torch.Tensor
    next_token: torch.Tensor


def _first_rejection(accepted: torch.Tensor) -> torch.Tensor:
    """Number of leading True values per row. accepted: [B, k] bool → [B] long."""
    return accepted.long().cumprod(dim=-1).sum(dim=-1)


def greedy_verify(drafts: Sequence[Sequence[int]], target_scores: torch.Tensor) -> tuple[list[int], list[int]]:
    """Accept while the draft token equals the target argmax, then emit the target's argmax (the bonus token
    after n = k_i accepted, else the correction), in one host read.

    drafts: B rows of k_i draft ids (ragged); target_scores: [B, K+1, V] processed target logits, K ≥ max k_i
    (row i's first k_i + 1 columns are its own) → accepted n_i and the emitted token per row, host ints.
    """
    targets = argmax(target_scores).tolist()  # B × [K+1]: the one host read
    accepted = [_agreeing(draft, target) for draft, target in zip(drafts, targets, strict=True)]
    return accepted, [target[n] for target, n in zip(targets, accepted, strict=True)]


def _agreeing(draft: Sequence[int], target: Sequence[int]) -> int:
    """How many of ``draft``'s leading ids equal ``target``'s at the same positions."""
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n


def process_scores(processor, ids: torch.Tensor, draft: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Apply logits processors position by position: scores_i sees ids + d_<i (moved to the logits' device).
    logits: [1, k+1, V]."""
    if not processor:
        return logits
    seen = torch.cat([ids, draft.to(ids.device)], dim=1).to(logits.device)  # [1, T + k]
    rows = [processor(seen[:, : ids.shape[1] + i], logits[:, i]) for i in range(logits.shape[1])]
    return torch.stack(rows, dim=1)  # [1, k+1, V]


def select_token(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from processed scores [B, V] → [B, 1] (on the scores' device)."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)
    return argmax(scores)[:, None]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)) over the last dim (Leviathan et al. 2023, Alg. 1); falls back to p where
    the residual is all zero (then p = q and a rejection has probability 0). p, q: [..., V]."""
    residual = (p - q).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(1e-30), p)


def speculative_sample(
    draft_tokens: torch.Tensor,
    q: torch.Tensor,
    p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verification:
    """Lossless speculative sampling (Leviathan et al. 2023 Alg. 1; Chen et al. 2023 Alg. 2).

    Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection sample
    from norm(max(0, p_i − q_i)); if all k are accepted, sample the bonus token from p_{k+1}.
    The emitted tokens are distributed exactly as sampling from p.

    draft_tokens: [B, k] long; q: [B, k, V] draft probabilities (one-hot for a deterministic drafter
    such as prompt lookup); p: [B, k+1, V] target probabilities.
    """
    batch, k = draft_tokens.shape
    p_tok = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    q_tok = q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # [B, k]
    r = torch.rand(batch, k, device=p.device, generator=generator)  # [B, k]
    n = _first_rejection(r * q_tok < p_tok)  # [B]; r < p/q without dividing by q
    q_pad = torch.cat([q, torch.zeros_like(p[:, :1])], dim=1)  # [B, k+1, V]; q_{k+1} = 0 → bonus from p
    idx = n[:, None, None].expand(-1, 1, p.shape[-1])  # [B, 1, V]
    dist = residual_distribution(p.gather(1, idx), q_pad.gather(1, idx)).squeeze(1)  # [B, V]
    next_token = torch.multinomial(dist, 1, generator=generator).squeeze(1)  # [B]
    return Verification(num_accepted=n, next_token=next_token)
