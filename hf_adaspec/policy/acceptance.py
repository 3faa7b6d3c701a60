"""Online per-request estimate of the acceptance rate α (the ``fixed`` baseline reports it with its goodput).

Model: each draft token is accepted independently with probability α, so a step that drafts k and
accepts n contributes n successes and, when n < k, one failure (the geometric likelihood; Leviathan
et al. 2023 §3.1). We keep discounted pseudo-counts with a Beta prior: every step multiplies the
counts by a decay γ < 1, so the estimate follows drift within a request, and during plain steps
(nothing drafted) it relaxes back towards the prior — which is what makes the controller try
speculation again after a bad patch instead of staying at k=0 for ever.
"""

from __future__ import annotations

from dataclasses import dataclass


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
