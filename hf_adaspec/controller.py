"""Controllers choose, each step, which drafter proposes and how many tokens k.

``GoodputController`` (SmartSpec/TurboSpec, arXiv 2406.14066): over every drafter's options, the
(drafter, k) maximising goodput(k) = E[tokens | k, α_d] / (k·t_draft,d + t_verify(k+1)), with t_*
measured (``CostTable``) and α_d from that drafter's online ``AcceptanceEstimator``; k = 0 is a plain
decoding step. With one drafter this is the adaptive method; with a draft model and prompt lookup it
is hybrid drafting (an n-gram proposal is verified only up to the k the goodput picks).
A k > 0 must beat plain decoding by ``min_gain`` (default 3%): estimates of α and costs are noisy,
and a marginal predicted gain is not worth the risk of losing to plain decoding.
``FixedController``: always k from the first drafter (capped by what it offers and the budget).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .acceptance import AcceptanceEstimator, AcceptancePrior
from .costs import CostTable
from .goodput import best_k, goodput


@dataclass(frozen=True)
class DraftOption:
    """What drafter ``drafter`` (an index) offers this step: up to ``k_upper`` tokens, after first
    ingesting ``catchup_tokens`` it has not seen."""

    drafter: int
    k_upper: int
    catchup_tokens: int = 0


@dataclass(frozen=True)
class DrafterCosts:
    """Per-drafter costs in ms: one draft token, and one token ingested while catching up."""

    draft_ms: float = 0.0
    catchup_ms: float = 0.0


@dataclass(frozen=True)
class Decision:
    """The chosen drafter and k, its α estimate and predicted goodput (tokens/s; NaN if unknown)."""

    k: int
    drafter: int
    alpha: float
    predicted_goodput: float


class Controller(Protocol):
    """Chooses (drafter, k) each step and learns from the outcome."""

    def choose(self, options: Sequence[DraftOption], horizon: int = 1) -> Decision:
        """Pick a drafter and k ≤ its k_upper; ``horizon`` = tokens left in the budget."""
        ...

    def observe(self, drafter: int, drafted: int, accepted: int) -> None:
        """Record that ``accepted`` of ``drafted`` tokens from ``drafter`` were accepted."""
        ...


class GoodputController:
    """Per-step (drafter, k) by maximum predicted goodput; k = 0 when speculation does not pay."""

    def __init__(
        self,
        costs: CostTable,
        drafters: Sequence[DrafterCosts],
        priors: Sequence[AcceptancePrior | None] | None = None,
        min_gain: float = 0.03,
    ) -> None:
        self.costs, self.drafters, self.min_gain = costs, list(drafters), min_gain
        self.estimators = [AcceptanceEstimator(p) for p in (priors or [None] * len(self.drafters))]

    def choose(self, options: Sequence[DraftOption], horizon: int = 1) -> Decision:
        first = options[0].drafter if options else 0
        plain = goodput(0.0, 0, 0.0, self.costs.t_verify)
        best = Decision(0, first, self.estimators[first].alpha, plain)
        for opt in options:
            cost, alpha = self.drafters[opt.drafter], self.estimators[opt.drafter].alpha
            choice = best_k(alpha, opt.k_upper, cost.draft_ms, self.costs.t_verify,
                            opt.catchup_tokens * cost.catchup_ms, horizon, self.min_gain)
            if choice.k and choice.goodput > best.predicted_goodput:
                best = Decision(choice.k, opt.drafter, alpha, choice.goodput)
        return best

    def observe(self, drafter: int, drafted: int, accepted: int) -> None:
        for i, estimator in enumerate(self.estimators):
            if i == drafter:
                estimator.update(drafted, accepted)
            else:
                estimator.update(0, 0)  # unused drafters relax towards their prior


class FixedController:
    """Always the same k from the first drafter (a fixed-length speculation baseline)."""

    def __init__(self, k: int, costs: CostTable | None = None, draft_ms: float = 0.0) -> None:
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        self.k, self.costs, self.draft_ms = k, costs, draft_ms
        self.estimator = AcceptanceEstimator()

    def choose(self, options: Sequence[DraftOption], horizon: int = 1) -> Decision:
        opt = options[0]
        k, alpha = min(self.k, opt.k_upper), self.estimator.alpha
        rate = goodput(alpha, k, self.draft_ms, self.costs.t_verify) if self.costs else float("nan")
        return Decision(k, opt.drafter, alpha, rate)

    def observe(self, drafter: int, drafted: int, accepted: int) -> None:
        self.estimator.update(drafted, accepted)
