"""The drafter interface: every proposer drafts, for each row of a batch, up to k_i tokens continuing it.

Notation: q = draft distribution. A deterministic drafter (prompt lookup) returns ``q=None``, which
verification treats as one-hot on its tokens. Rows are kept as ``Rows``: each row's padded view (its
left padding, prompt and generated tokens, which is what logits processors and stopping criteria see,
as in transformers' batched generate) and where its real tokens start. A single request is B = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Proposal:
    """One row's draft tokens [1, k] long and, for sampling, their draft probabilities q [1, k, V] (else
    None); ``confidences``: q(x_u) of each drafted token (empty for deterministic drafters)."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    confidences: tuple[float, ...] = ()

    @property
    def k(self) -> int:
        """Proposal length (tokens)."""
        return self.tokens.shape[1]


@dataclass(frozen=True)
class Rows:
    """views: per row a [T_i] long tensor (left padding + tokens); starts: per row its padding length."""

    views: tuple[torch.Tensor, ...]
    starts: tuple[int, ...]

    def tokens(self, i: int) -> torch.Tensor:
        """Row i's real tokens (prompt + generated), [n_i] long."""
        return self.views[i][self.starts[i] :]

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens per row, [B] long."""
        return torch.tensor([v.shape[0] - s for v, s in zip(self.views, self.starts, strict=True)])


StopRule = Callable[[int, Sequence[tuple[float, ...]], Sequence[bool]], bool]
"""stop(j, confidences, growing) → True to end drafting after j columns: per row its confidences so far
(q(x_u) of its kept tokens) and whether it could take one more token."""


class Proposer(Protocol):
    """What the engine needs from a drafter."""

    name: str
    costless: bool  # proposes without a forward: every step can score what it would have proposed (hindsight)

    def available(self, rows: Rows, k_max: int) -> list[int]:
        """Most draft tokens each row can get now (≤ k_max)."""
        ...

    def evidence(self, rows: Rows) -> list[int]:
        """Per row, what predicts the acceptance of the offer the last ``available`` call found (prompt
        lookup: its match length; 0 for a drafter without such a signal)."""
        ...

    def catchup_tokens(self, rows: Rows) -> int:
        """Columns beyond steady state the drafter must ingest before drafting (0 if none)."""
        ...

    def propose(self, rows: Rows, ks: Sequence[int], stop: StopRule | None = None) -> list[Proposal]:
        """Row i's proposal of up to ks[i] tokens ([1, k_i'] tokens; q [1, k_i', V] when sampling). A
        drafter with confidences (the draft model) asks ``stop`` after each drafted column."""
        ...

    def rollback(self, lengths: torch.Tensor) -> None:
        """The first lengths[i] tokens of row i are confirmed; forget state past them."""
        ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep only rows ``rows`` ([b] long indices; finished rows leave)."""
        ...
