"""The drafter interface: every proposer turns the tokens so far into up to k draft tokens.

Notation: q = draft distribution. A deterministic drafter (prompt lookup) returns ``q=None``, which
verification treats as one-hot on its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Proposal:
    """Draft tokens [B, k] long and, for sampling, their draft probabilities q [B, k, V] (else None);
    ``confidences``: q(x_u) of each drafted token (empty for deterministic drafters, and from the batch
    draft model when no stop rule asked for them)."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    confidences: tuple[float, ...] = ()

    @property
    def k(self) -> int:
        """Proposal length (tokens)."""
        return self.tokens.shape[1]

    def head(self, k: int) -> Proposal:
        """The first k ≤ self.k draft tokens (tokens [B, k], q [B, k, V], their confidences)."""
        q = self.q[:, :k] if self.q is not None else None
        return Proposal(self.tokens[:, :k], q, self.confidences[:k])


class Proposer(Protocol):
    """What the engine needs from a drafter."""

    name: str

    def available(self, tokens: torch.Tensor, k_max: int) -> int:
        """Most draft tokens this drafter can offer now (≤ k_max). tokens: [B, T] long."""
        ...

    def catchup_tokens(self, tokens: torch.Tensor) -> int:
        """Tokens beyond steady state the drafter must ingest before it can draft (0 if none)."""
        ...

    def propose(self, tokens: torch.Tensor, k: int) -> Proposal:
        """Draft up to ``k`` ≥ 1 tokens continuing ``tokens`` [B, T]. A drafter with confidences (the
        draft model) also takes ``stop=fn(j, confidences) -> bool``, asked after each drafted token."""
        ...

    def rollback(self, length: int) -> None:
        """The first ``length`` tokens are confirmed; forget any state past them."""
        ...
