"""Per-request proposal lengths for a static batch, chosen by batch goodput.

``BatchGoodputController`` (SmartSpec, arXiv 2406.14066): each row i keeps its own online α_i; each
step the batch-wide k maximises Σ_i E[tokens | min(k, u_i), α_i] / (k·t_draft(b) + t_verify_b(k+1)),
with the step costs measured at the current batch size b (``costs_for(b)``), down to k = 0 when a
plain batched step wins. Row i then drafts k_i = min(k, u_i), u_i being what its drafter offers and its
budget allows. In a padded batch every row is verified over k + 1 positions, so a row's own k_i only
falls below k when it can offer no more; as b grows a verified position costs more and k shrinks.
``BatchFixedController``: k_i = min(k, u_i) always (the fixed-length baseline).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .acceptance import AcceptanceEstimator, AcceptancePrior
from .costs import CostTable
from .goodput import best_batch_k


@dataclass(frozen=True)
class BatchDecision:
    """Per-row proposal lengths k_i, the rows' α estimates and the predicted batch goodput (tokens/s)."""

    ks: tuple[int, ...]
    alphas: tuple[float, ...]
    predicted_goodput: float


class BatchGoodputController:
    """Batch-wide k by maximum predicted batch goodput; per-row α; k = 0 when speculation does not pay.

    costs_for(b) → the ``CostTable`` measured at batch size b; ``draft_model``: whether proposing costs
    a draft forward (False for prompt lookup).
    """

    def __init__(
        self,
        costs_for: Callable[[int], CostTable],
        batch: int,
        draft_model: bool,
        prior: AcceptancePrior | None = None,
        min_gain: float = 0.03,
    ) -> None:
        self.costs_for, self.draft_model, self.min_gain = costs_for, draft_model, min_gain
        self.estimators = [AcceptanceEstimator(prior) for _ in range(batch)]

    def choose(self, uppers: Sequence[int], catchup_tokens: int = 0, horizon: int = 1) -> BatchDecision:
        """uppers: [b] most tokens each row can draft; catchup_tokens: columns the draft must ingest
        first; horizon: tokens per row still to come."""
        costs = self.costs_for(len(uppers))
        alphas = [e.alpha for e in self.estimators]
        draft_ms = costs.draft_ms if self.draft_model else 0.0
        setup_ms = catchup_tokens * costs.draft_catchup_ms if self.draft_model else 0.0
        choice = best_batch_k(alphas, uppers, draft_ms, costs.t_verify, setup_ms, horizon * len(uppers), self.min_gain)
        return BatchDecision(tuple(min(choice.k, u) for u in uppers), tuple(alphas), choice.goodput)

    def observe(self, ks: Sequence[int], accepted: Sequence[int]) -> None:
        """Row i drafted ks[i] tokens and ``accepted[i]`` of them were kept."""
        for estimator, k, n in zip(self.estimators, ks, accepted, strict=True):
            estimator.update(k, n)

    def select(self, rows: torch.Tensor) -> None:
        """Keep the estimators of rows ``rows`` ([b] long indices; finished rows leave)."""
        self.estimators = [self.estimators[int(i)] for i in rows]


class BatchFixedController:
    """k_i = min(k, u_i) for every row and step (the fixed-length baseline; no goodput prediction)."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        self.k = k

    def choose(self, uppers: Sequence[int], catchup_tokens: int = 0, horizon: int = 1) -> BatchDecision:
        """k_i = min(k, u_i); α and goodput are NaN (nothing is estimated)."""
        return BatchDecision(tuple(min(self.k, u) for u in uppers), (float("nan"),) * len(uppers), float("nan"))

    def observe(self, ks: Sequence[int], accepted: Sequence[int]) -> None:
        """Nothing to learn."""

    def select(self, rows: torch.Tensor) -> None:
        """Stateless per row."""
