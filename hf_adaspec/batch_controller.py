"""Per-request proposal lengths (and drafters) for a static batch, chosen by batch goodput.

``BatchGoodputController`` (SmartSpec, arXiv 2406.14066): every row i keeps an online α per drafter;
each step ``best_batch_plan`` picks the batch-wide k and each row's drafter maximising
Σ_i E[tokens | min(k, u_di), α_di] / (k·t_draft(b) + t_verify_b(k+1)), with the step costs measured at
the current batch size b (``costs_for(b)``), down to k = 0 when a plain batched step wins. Row i then
drafts k_i = min(k, u_di) with its drafter d. In a padded batch every row is verified over k + 1
positions, so a row's own k_i only falls below k when its drafter offers no more; as b grows a verified
position costs more and k shrinks. With a draft model and prompt lookup this is hybrid drafting per row:
the draft model's batched forward is paid only when some row is better off with it.
``BatchFixedController``: k_i = min(k, u_0i) from the first drafter always (the fixed-length baseline).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .acceptance import AcceptanceEstimator, AcceptancePrior, observe_drafters
from .costs import CostTable
from .goodput import best_batch_plan


@dataclass(frozen=True)
class BatchDecision:
    """Per-row proposal lengths k_i and drafter indices, the chosen drafters' α estimates, and the
    predicted batch goodput (tokens/s; NaN when not predicted)."""

    ks: tuple[int, ...]
    drafters: tuple[int, ...]
    alphas: tuple[float, ...]
    predicted_goodput: float


class BatchGoodputController:
    """Batch-wide k and per-row drafters by maximum predicted batch goodput; k = 0 when it does not pay.

    costs_for(b) → the ``CostTable`` measured at batch size b; ``draft_models[d]``: whether drafter d
    costs a draft forward (True for a draft model, False for prompt lookup); priors: one per drafter.
    """

    def __init__(
        self,
        costs_for: Callable[[int], CostTable],
        batch: int,
        draft_models: Sequence[bool],
        priors: Sequence[AcceptancePrior | None] | None = None,
        min_gain: float = 0.03,
    ) -> None:
        self.costs_for, self.draft_models, self.min_gain = costs_for, list(draft_models), min_gain
        priors = list(priors) if priors is not None else [None] * len(self.draft_models)
        self.estimators = [[AcceptanceEstimator(prior) for _ in range(batch)] for prior in priors]  # [D][b]

    def choose(self, uppers: Sequence[Sequence[int]], catchup: Sequence[int], horizon: int = 1) -> BatchDecision:
        """uppers[d][i]: most tokens drafter d offers row i; catchup[d]: columns drafter d must ingest
        first; horizon: tokens per row still to come."""
        costs = self.costs_for(len(uppers[0]))
        alphas = [[e.alpha for e in row] for row in self.estimators]
        draft_ms = [costs.draft_ms if m else 0.0 for m in self.draft_models]
        setup = [c * costs.draft_catchup_ms if m else 0.0 for c, m in zip(catchup, self.draft_models, strict=True)]
        plan = best_batch_plan(alphas, uppers, draft_ms, costs.t_verify, setup, horizon * len(uppers[0]),
                               self.min_gain)
        ks = tuple(min(plan.k, uppers[d][i]) for i, d in enumerate(plan.drafters))
        chosen = tuple(alphas[d][i] for i, d in enumerate(plan.drafters))
        return BatchDecision(ks, plan.drafters, chosen, plan.goodput)

    def observe(self, drafters: Sequence[int], ks: Sequence[int], accepted: Sequence[int],
                confidences: Sequence[tuple[float, ...]] = ()) -> None:
        """Row i drafted ks[i] tokens with drafter drafters[i] and ``accepted[i]`` were kept
        (``observe_drafters`` per row). ``confidences`` (per row q(x_u)) are not used."""
        for i, (d, k, n) in enumerate(zip(drafters, ks, accepted, strict=True)):
            observe_drafters([row[i] for row in self.estimators], d, k, n)

    def select(self, rows: torch.Tensor) -> None:
        """Keep the estimators of rows ``rows`` ([b] long indices; finished rows leave)."""
        self.estimators = [[row[int(i)] for i in rows] for row in self.estimators]


class BatchFixedController:
    """k_i = min(k, u_0i) with the first drafter for every row and step (no goodput prediction)."""

    def __init__(self, k: int) -> None:
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        self.k = k

    def choose(self, uppers: Sequence[Sequence[int]], catchup: Sequence[int], horizon: int = 1) -> BatchDecision:
        """k_i = min(k, u_0i); α and goodput are NaN (nothing is estimated)."""
        rows = len(uppers[0])
        ks = tuple(min(self.k, u) for u in uppers[0])
        return BatchDecision(ks, (0,) * rows, (float("nan"),) * rows, float("nan"))

    def observe(self, drafters: Sequence[int], ks: Sequence[int], accepted: Sequence[int],
                confidences: Sequence[tuple[float, ...]] = ()) -> None:
        """Nothing to learn."""

    def select(self, rows: torch.Tensor) -> None:
        """Stateless per row."""
