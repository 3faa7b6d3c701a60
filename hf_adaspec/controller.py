"""Controllers choose the proposal length k for each step.

``GoodputController`` (SmartSpec/TurboSpec, arXiv 2406.14066): k ∈ {0..k_upper} maximising
goodput(k) = E[tokens | k, α] / (k·t_draft + t_verify(k+1)) with t_* from the measured ``CostTable``
and α from the request's online ``AcceptanceEstimator``; k = 0 is a plain decoding step.
A k > 0 must beat plain decoding by ``min_gain`` (default 3%): estimates of α and costs are noisy,
and a marginal predicted gain is not worth the risk of losing to plain decoding.
``FixedController``: always k (capped by what the drafter offers and the token budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .acceptance import AcceptanceEstimator, AcceptancePrior
from .costs import CostTable
from .goodput import best_k, goodput


@dataclass(frozen=True)
class Decision:
    """The chosen k, with the α estimate and predicted goodput (tokens/s; NaN without a cost table)."""

    k: int
    alpha: float
    predicted_goodput: float


class Controller(Protocol):
    """Chooses k each step and learns from the outcome."""

    def choose(self, k_upper: int, catchup_tokens: int = 0, horizon: int = 1) -> Decision:
        """Pick k ∈ {0..k_upper}; the drafter must first ingest ``catchup_tokens``; ``horizon`` =
        tokens left in the budget."""
        ...

    def observe(self, drafted: int, accepted: int) -> None:
        """Record that ``accepted`` of ``drafted`` tokens were accepted."""
        ...


class GoodputController:
    """Per-step k by maximum predicted goodput; falls back to k=0 when speculation does not pay."""

    def __init__(self, costs: CostTable, prior: AcceptancePrior | None = None, min_gain: float = 0.03) -> None:
        self.costs, self.min_gain = costs, min_gain
        self.estimator = AcceptanceEstimator(prior)

    def choose(self, k_upper: int, catchup_tokens: int = 0, horizon: int = 1) -> Decision:
        alpha = self.estimator.alpha
        setup_ms = catchup_tokens * self.costs.draft_catchup_ms
        choice = best_k(alpha, k_upper, self.costs.draft_ms, self.costs.t_verify, setup_ms, horizon, self.min_gain)
        return Decision(choice.k, alpha, choice.goodput)

    def observe(self, drafted: int, accepted: int) -> None:
        self.estimator.update(drafted, accepted)


class FixedController:
    """Always the same k (a fixed-length speculation baseline)."""

    def __init__(self, k: int, costs: CostTable | None = None) -> None:
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        self.k, self.costs = k, costs
        self.estimator = AcceptanceEstimator()

    def choose(self, k_upper: int, catchup_tokens: int = 0, horizon: int = 1) -> Decision:
        k = min(self.k, k_upper)
        alpha = self.estimator.alpha
        rate = goodput(alpha, k, self.costs.draft_ms, self.costs.t_verify) if self.costs else float("nan")
        return Decision(k, alpha, rate)

    def observe(self, drafted: int, accepted: int) -> None:
        self.estimator.update(drafted, accepted)
