"""Acceptance models: what the controller predicts a drafter's proposal gets accepted, P_1..P_u per row.

- ``IIDAcceptance``: an online per-request estimate of the acceptance rate α, P_j = α^j (the ``fixed``
  baseline reports it with its goodput).
- ``ConfidenceAcceptance``: the draft model's calibrated confidence (AdaSpec, arXiv 2503.05096).
- ``match.MatchAcceptance``: a costless drafter's acceptance by its match length.

The i.i.d. estimate: each draft token is accepted independently with probability α, so a step that drafts k and
accepts n contributes n successes and, when n < k, one failure (the geometric likelihood; Leviathan
et al. 2023 §3.1). We keep discounted pseudo-counts with a Beta prior: every step multiplies the
counts by a decay γ < 1, so the estimate follows drift within a request, and during plain steps
(nothing drafted) it relaxes back towards the prior — which is what makes the controller try
speculation again after a bad patch instead of staying at k=0 for ever.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .confidence import PESSIMISM, ConfidenceCalibrator, RunningMean, prefix_confidences, shifted_rate
from .match import MatchAcceptance


@dataclass(frozen=True)
class AcceptancePrior:
    """Beta(a, b) prior over α, as a mean and a strength (pseudo-trials); decay γ per step."""

    mean: float = 0.6
    strength: float = 4.0
    decay: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 < self.mean < 1.0:
            raise ValueError(f"prior mean must be in (0, 1), got {self.mean}")
        if self.strength <= 0:
            raise ValueError(f"prior strength must be > 0, got {self.strength}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


class AcceptanceEstimator:
    """Discounted Beta-geometric estimate of α for one request."""

    def __init__(self, prior: AcceptancePrior | None = None) -> None:
        self.prior = prior or AcceptancePrior()
        self.successes = 0.0
        self.trials = 0.0

    @property
    def alpha(self) -> float:
        """Posterior mean of α, in (0, 1)."""
        a = self.prior.mean * self.prior.strength
        return (a + self.successes) / (self.prior.strength + self.trials)

    def update(self, drafted: int, accepted: int) -> None:
        """Record one step: ``drafted`` = k tokens proposed, ``accepted`` = n ≤ k of them kept.

        Raises:
            ValueError: accepted outside [0, drafted].
        """
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted must be in [0, {drafted}], got {accepted}")
        self.successes *= self.prior.decay
        self.trials *= self.prior.decay
        self.successes += accepted
        self.trials += accepted + (1 if accepted < drafted else 0)


class IIDAcceptance:
    """Per row, a discounted Beta-geometric α (``AcceptanceEstimator``); P_j = α^j."""

    confidence_stopped = False

    def __init__(self, batch: int, prior: AcceptancePrior | None = None) -> None:
        self.rows = [AcceptanceEstimator(prior) for _ in range(batch)]

    def see(self, evidence: Sequence[int]) -> None:
        """No evidence used: one α per row."""

    def path(self, i: int, upper: int) -> tuple[float, ...]:
        alpha = self.rows[i].alpha
        return tuple(alpha**j for j in range(1, upper + 1))

    def floor(self, i: int, upper: int) -> tuple[float, ...]:
        """Lower confidence bounds of row i's (P_1..P_upper): α less ``PESSIMISM`` standard errors, to the j."""
        row = self.rows[i]
        low = shifted_rate(row.alpha, row.prior.strength + row.trials, -PESSIMISM)
        return tuple(low**j for j in range(1, upper + 1))

    def alpha(self, i: int) -> float:
        return self.rows[i].alpha

    def observe(self, i: int, drafted: int, accepted: int, confidences: tuple[float, ...]) -> None:
        """Row i drafted ``drafted`` with this drafter; a plain step (0) relaxes α towards its prior."""
        self.rows[i].update(drafted, accepted)

    def select(self, rows: torch.Tensor) -> None:
        self.rows = [self.rows[int(i)] for i in rows]


class ConfidenceAcceptance:
    """The pair's confidence calibration and, per row, its running mean per-token confidence c̄ (seeded
    with the pair's mean); P_j = calibrated(c̄^j) before drafting, calibrated(c_j) once drafted."""

    confidence_stopped = True

    def __init__(self, batch: int, calibrator: ConfidenceCalibrator) -> None:
        self.calibrator = calibrator
        self.c_bar = [RunningMean(calibrator.token_mean) for _ in range(batch)]

    def see(self, evidence: Sequence[int]) -> None:
        """No evidence before drafting: the confidences come with the drafted tokens."""

    def path(self, i: int, upper: int) -> tuple[float, ...]:
        c = self.c_bar[i].value
        return tuple(self.calibrator.predict(c**j) for j in range(1, upper + 1))

    def floor(self, i: int, upper: int) -> tuple[float, ...]:
        """Lower confidence bounds of row i's (P_1..P_upper) before drafting, along ĉ_j = c̄^j."""
        c = self.c_bar[i].value
        return tuple(self.calibrator.predict_lower(c**j) for j in range(1, upper + 1))

    def alpha(self, i: int) -> float:
        return self.calibrator.predict(self.c_bar[i].value)

    def drafted(self, confidences: tuple[float, ...], lower: bool = False) -> list[float]:
        """Calibrated P_1..P_j of the tokens drafted so far, from their q(x_u) (``lower``: their lower
        confidence bounds)."""
        predict = self.calibrator.predict_lower if lower else self.calibrator.predict
        return [predict(c) for c in prefix_confidences(confidences)]

    def next_prob(self, i: int, confidences: tuple[float, ...], lower: bool = False) -> float:
        """Predicted P_{j+1} of row i: calibrated(c_j·c̄) (``lower``: its lower confidence bound)."""
        predict = self.calibrator.predict_lower if lower else self.calibrator.predict
        return predict(min(1.0, math.prod(confidences) * self.c_bar[i].value))

    def observe(self, i: int, drafted: int, accepted: int, confidences: tuple[float, ...]) -> None:
        """Fold a verified draft into the pooled calibration and row i's c̄; a plain step leaves both."""
        if confidences:
            self.calibrator.update(confidences, accepted)
            for q in confidences:
                self.c_bar[i].add(q)

    def select(self, rows: torch.Tensor) -> None:
        self.c_bar = [self.c_bar[int(i)] for i in rows]


AcceptanceModel = IIDAcceptance | ConfidenceAcceptance | MatchAcceptance
