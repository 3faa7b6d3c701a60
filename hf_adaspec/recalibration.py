"""Per-request recalibration of the draft's confidence calibration: observed over expected accepted tokens.

Notation: q = draft, p = target. The pair's ``ConfidenceCalibrator`` maps the draft's confidence to
P_j = P(prefix of j drafts accepted), pooled over every request. A request whose draft is confident but
often wrong (Spec-Bench translation: P_1 predicted at 0.77–0.94 on most steps while 8 of 14 and 15 of 24
drafted tokens were accepted; ``benchmarks/confidence_trace.py``) keeps being predicted to pay. Within a
request the controller can therefore scale the calibrated P_j by ρ, the request's accepted draft tokens
O over the tokens the calibration expected, E = Σ P_j over the verified prefixes, shrunk to 1 by a
Gamma(w, w) prior worth w expected tokens:

    ρ = (O + w) / (E + w)

the Poisson–Gamma empirical-Bayes estimate of a ratio of observed to expected counts (Clayton & Kaldor
1987, Biometrics 43). As an α estimator relaxes on plain steps (``acceptance.observe_drafters``), O and
E decay by γ per plain step, so a request that stopped drafting drifts back to ρ = 1 and may try again.
Opt-in (``recalibrate=True``): on 52 Spec-Bench prompts it changed nothing beyond noise (confidence
1.102x vs 1.101x plain, translation 0.98x vs 0.97x; README, Benchmark).
"""

from __future__ import annotations

from dataclasses import dataclass


def recalibration_ratio(observed: float, expected: float, weight: float) -> float:
    """ρ = (O + w) / (E + w): accepted draft tokens over those the calibration expected, shrunk to 1.

    Raises:
        ValueError: observed or expected < 0, or weight not > 0.
    """
    if observed < 0 or expected < 0 or not weight > 0:
        raise ValueError(f"need observed >= 0, expected >= 0, weight > 0; got {observed}, {expected}, {weight}")
    return (observed + weight) / (expected + weight)


@dataclass
class RequestRecalibration:
    """One request's O and E (draft tokens); ``active`` False keeps ρ = 1 (the pooled calibration as is).

    ``weight``: w, the prior's strength in expected tokens; ``decay``: γ per plain step."""

    active: bool = True
    weight: float = 4.0
    decay: float = 0.9
    observed: float = 0.0
    expected: float = 0.0

    def __post_init__(self) -> None:
        if not self.weight > 0 or not 0.0 < self.decay <= 1.0:
            raise ValueError(f"need weight > 0 and decay in (0, 1]; got {self.weight}, {self.decay}")

    @property
    def ratio(self) -> float:
        """ρ for the next prediction (1.0 when inactive)."""
        return recalibration_ratio(self.observed, self.expected, self.weight) if self.active else 1.0

    def scale(self, p: float) -> float:
        """A calibrated probability P_j scaled by ρ, at most 1."""
        return min(1.0, self.ratio * p)

    def update(self, predicted: list[float], accepted: int) -> None:
        """One verified proposal: the pooled calibration's P_1..P_k for its drafted prefixes, n accepted.

        Raises:
            ValueError: accepted outside [0, k].
        """
        if not 0 <= accepted <= len(predicted):
            raise ValueError(f"accepted must be in [0, {len(predicted)}], got {accepted}")
        self.observed += accepted
        self.expected += sum(predicted)

    def relax(self) -> None:
        """A plain step: decay O and E by γ, so ρ drifts back to 1."""
        self.observed *= self.decay
        self.expected *= self.decay
