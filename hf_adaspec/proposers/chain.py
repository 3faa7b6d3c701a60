"""A paid drafter's chain: one token per row per forward, kept per row, stopped by EOS, each row's k_i
or the controller's stop rule — shared by every drafter that runs a model (the draft model, a draft head).

Notation: q = draft distribution. ``Sampler`` turns a column's logits into tokens: greedy (with the
token's q(x) as its confidence when a stop rule asks for confidences) or sampled from the processed q
(lossless speculative sampling needs q, Leviathan et al. 2023, Alg. 1).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..backend import hf_compat
from ..kernels.argmax import argmax
from .base import Proposals, StopRule


@dataclass(frozen=True)
class Sampler:
    """How a column's tokens are drawn: logits processors (once over the column where they read only the
    scores, else row by row on each row's own tokens),
    greedy or sampling, the generator, and the EOS ids a proposal is cut after."""

    logits_processor: object
    do_sample: bool
    eos: torch.Tensor  # [n_eos] long
    generator: torch.Generator | None = None

    @functools.cached_property
    def position_free(self) -> bool:
        """Whether the processors read only the scores (``hf_compat.position_free``): then they run once over
        every row's column, else row by row on each row's own tokens."""
        return hf_compat.position_free(self.logits_processor)

    def draw(
        self, views: list[torch.Tensor], logits: torch.Tensor, confident: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """One draft token per row from logits [b, V] → tokens [b], q [b, V] (None when greedy) and, if
        ``confident``, the tokens' q(x) [b] under the processed scores (else None). Greedy draws stay on the
        logits' device; sampling runs on the CPU, where its generator is."""
        scores = logits.cpu() if self.do_sample else logits
        if self.logits_processor and self.position_free:  # they read only the scores: once for every row
            scores = self.logits_processor(torch.zeros(len(views), 1, dtype=torch.long, device=scores.device), scores)
        elif self.logits_processor:  # processors see each row's own tokens, so they run row by row
            scores = torch.cat(
                [self.logits_processor(v[None].to(scores.device), scores[i : i + 1]) for i, v in enumerate(views)]
            )
        if not self.do_sample:
            token = argmax(scores)  # [b]
            if not confident:
                return token, None, None
            f = scores.float()
            shifted = f - f.gather(1, token[:, None])  # the largest value at the argmax: ≤ 0 everywhere
            return token, None, 1.0 / shifted.exp_().sum(dim=-1)  # softmax at the argmax
        q = torch.softmax(scores, dim=-1)  # [b, V]
        token = torch.multinomial(q, 1, generator=self.generator)  # [b, 1]
        return token.squeeze(1), q, q.gather(1, token).squeeze(1) if confident else None


def draft_chain(
    column: Callable[[int, torch.Tensor | None], torch.Tensor],
    views: Sequence[torch.Tensor],
    ks: Sequence[int],
    sampler: Sampler,
    stop: StopRule | None = None,
) -> Proposals:
    """Row i gets up to ks[i] tokens cut just after an EOS and, when sampling, their q, flat ([Σ k_i'], q
    [Σ k_i', V]).

    ``column(j, previous)`` runs the drafter's forward for column j (``previous``: the tokens [b] drawn at
    column j − 1, None for the first) → logits [b, V]. With a ``stop`` rule, asked after each column,
    drafting may end early and every proposal carries its tokens' confidences q(x_u) (without one they are
    left empty: a softmax per column saved). ``views``: each row's padded view (what processors see).
    """
    b, views, kept = len(views), list(views), list(ks)  # row i keeps its first kept[i] tokens
    drafted, probs, table, token = [], [], [[] for _ in range(b)], None  # table: per row its confidences
    eos = set(sampler.eos.tolist())
    for j in range(max(ks)):
        token, q, conf = sampler.draw(views, column(j, token), stop is not None)  # [b], [b, V], [b]
        host, conf = _to_host(token, conf)  # one transfer per column; ``token`` stays where the drafter runs
        drafted.append(host)
        probs.append(q)
        if conf is not None:
            for row, c in zip(table, conf.tolist(), strict=True):
                row.append(c)
        if eos:
            kept = [j + 1 if k > j and t in eos else k for k, t in zip(kept, host.tolist(), strict=True)]
        if sampler.logits_processor:
            views = [torch.cat([v, host[i : i + 1]]) for i, v in enumerate(views)]
        growing = [k > j + 1 for k in kept]
        if not any(growing):
            break
        if stop is not None and stop(j + 1, [tuple(r[:k]) for r, k in zip(table, kept, strict=True)], growing):
            break
    out = torch.stack(drafted, dim=1)  # [b, J]
    width = out.shape[1]
    kept = [min(k, width) for k in kept]
    offsets = [0]
    for k in kept:
        offsets.append(offsets[-1] + k)
    confidences = tuple(tuple(row[:k]) for row, k in zip(table, kept, strict=True)) if stop is not None else ()
    if min(kept) == width:  # every row kept every column: the flat layout is the block's
        q = torch.stack(probs, dim=1).reshape(-1, probs[0].shape[-1]) if sampler.do_sample else None  # [Σ k_i, V]
        return Proposals(out.reshape(-1), tuple(offsets), q, confidences)
    keep = torch.arange(width)[None, :] < torch.tensor(kept)[:, None]  # [b, J]: each row's first k_i
    q = torch.stack(probs, dim=1)[keep.to(probs[0].device)] if sampler.do_sample else None  # [Σ k_i, V]
    return Proposals(out[keep], tuple(offsets), q, confidences)


def _to_host(token: torch.Tensor, conf: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A column's tokens [b] long and confidences [b] (or None) on the CPU, in one transfer (ids below 2^24
    are exact in float32)."""
    if conf is None:
        return token.cpu(), None
    both = torch.stack([token.float(), conf.float()]).cpu()  # [2, b]
    return both[0].long(), both[1]
