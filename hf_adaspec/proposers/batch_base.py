"""The batch drafter interface: one proposal per active row of a static batch.

Rows are kept as ``BatchRows``: each row's padded view (its left padding, prompt and generated tokens,
which is what logits processors and stopping criteria see, as in transformers' batched generate) and
where its real tokens start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .base import Proposal


@dataclass(frozen=True)
class BatchRows:
    """views: per row a [T_i] long tensor (left padding + tokens); starts: per row its padding length."""

    views: tuple[torch.Tensor, ...]
    starts: tuple[int, ...]

    def tokens(self, i: int) -> torch.Tensor:
        """Row i's real tokens (prompt + generated), [n_i] long."""
        return self.views[i][self.starts[i] :]

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens per row, [b] long."""
        return torch.tensor([v.shape[0] - s for v, s in zip(self.views, self.starts, strict=True)])


BatchStopRule = Callable[[int, Sequence[tuple[float, ...]], Sequence[bool]], bool]
"""stop(j, confidences, growing) → True to end drafting after j columns: per row its confidences so far
(q(x_u) of its kept tokens) and whether it could take one more token."""


class BatchProposer(Protocol):
    """What the batch engine needs from a drafter."""

    name: str

    def available(self, rows: BatchRows, k_max: int) -> list[int]:
        """Most draft tokens each row can get now (≤ k_max)."""
        ...

    def catchup_tokens(self, rows: BatchRows) -> int:
        """Columns beyond steady state the drafter must ingest before drafting (0 if none)."""
        ...

    def propose(self, rows: BatchRows, ks: Sequence[int], stop: BatchStopRule | None = None) -> list[Proposal]:
        """Row i's proposal of up to ks[i] tokens ([1, k_i'] tokens; q [1, k_i', V] when sampling). A
        drafter with confidences (the draft model) asks ``stop`` after each drafted column."""
        ...

    def rollback(self, lengths: torch.Tensor) -> None:
        """The first lengths[i] tokens of row i are confirmed; forget state past them."""
        ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep only rows ``rows`` ([b] long indices)."""
        ...
