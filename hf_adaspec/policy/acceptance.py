"""Online per-request estimate of the acceptance rate α.

Model: each draft token is accepted independently with probability α, so a step that drafts k and
accepts n contributes n successes and, when n < k, one failure (the geometric likelihood; Leviathan
et al. 2023 §3.1). We keep discounted pseudo-counts with a Beta prior: every step multiplies the
counts by a decay γ < 1, so the estimate follows drift within a request, and during plain steps
(nothing drafted) it relaxes back towards the prior — which is what makes the controller try
speculation again after a bad patch instead of staying at k=0 for ever.
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Sequence
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


@functools.lru_cache(maxsize=64)
def beta_quantile(mean: float, strength: float, quantile: float, cells: int = 4096) -> float:
    """The ``quantile`` ∈ [0, 1] of α ~ Beta(mean·strength, (1 − mean)·strength), the ``AcceptancePrior``
    read as a spread of per-request rates: the CDF by the midpoint rule on ``cells`` equal cells of (0, 1)
    (about 1 ms, so cached: every new request of a pair without history asks for the same value).

    Raises:
        ValueError: mean outside (0, 1), strength ≤ 0, or quantile outside [0, 1].
    """
    if not 0.0 < mean < 1.0 or strength <= 0:
        raise ValueError(f"need a mean in (0, 1) and a strength > 0, got {mean}, {strength}")
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    a, b = mean * strength, (1.0 - mean) * strength
    xs = [(i + 0.5) / cells for i in range(cells)]
    density = [math.exp((a - 1) * math.log(x) + (b - 1) * math.log1p(-x)) for x in xs]
    total, running = sum(density), 0.0
    for x, d in zip(xs, density, strict=True):
        running += d
        if running >= quantile * total:
            return x
    return xs[-1]


def nearest_rank(values: Sequence[float], quantile: float) -> float:
    """The ``quantile`` ∈ [0, 1] of ``values`` by nearest rank (the smallest value with at least that
    share of ``values`` at or below it). Raises ValueError when ``values`` is empty."""
    if not values:
        raise ValueError("nearest_rank needs at least one value")
    ranked = sorted(values)
    return ranked[max(0, math.ceil(quantile * len(ranked)) - 1)]


class AcceptanceMemory:
    """α carried across requests of one (target, drafter) pair, so a new request starts from what the
    pair achieved before.

    A new request's prior mean (``prior_for``) is the ``quantile`` (nearest rank; 0.75) of the acceptance
    rates of the pair's last ``size`` requests that drafted at least ``min_drafted`` tokens, once
    ``min_requests`` have; until then the drafter's own ``start`` rate, else the ``quantile`` of the
    initial prior read as a spread of rates, Beta(mean·strength, (1 − mean)·strength) (``beta_quantile``),
    clamped to [0.05, 0.95].
    Why an upper quantile, not the mean: acceptance differs more between requests than within one
    (greedy draft agreement 0.52 on roleplay to 0.93 on math), and a request whose prior is the pair's
    mean does not draft when only well-predicted requests pay, so it never learns that it is one of
    them (docs/experiments.md, the α-prior ablation). Optimism in the face of uncertainty: the request
    drafts, and its own estimator pulls α down within a few steps when it is not such a request.
    """

    def __init__(self, initial: AcceptancePrior | None = None, quantile: float = 0.75, size: int = 64,
                 min_drafted: int = 4, min_requests: int = 3) -> None:
        if size < 1 or min_drafted < 1 or min_requests < 1:
            raise ValueError(f"size, min_drafted and min_requests must be >= 1, got {size}, {min_drafted}, "
                             f"{min_requests}")
        if not 0.0 <= quantile <= 1.0:
            raise ValueError(f"quantile must be in [0, 1], got {quantile}")
        self.initial, self.quantile, self.size = initial or AcceptancePrior(), quantile, size
        self.min_drafted, self.min_requests = min_drafted, min_requests
        self._rates: dict[str, collections.deque[float]] = {}

    def prior_for(self, key: str, start: float | None = None) -> AcceptancePrior:
        """The prior for the next request with drafter ``key``: the ``quantile`` of its recent requests'
        acceptance rates; until there are ``min_requests``, ``start`` if given (prompt lookup:
        ``LOOKUP_START_ALPHA``), else that quantile of the initial prior's Beta."""
        rates = self._rates.get(key, ())
        if len(rates) >= self.min_requests:
            mean = nearest_rank(rates, self.quantile)
        elif start is not None:
            mean = start
        else:
            mean = beta_quantile(self.initial.mean, self.initial.strength, self.quantile)
        return AcceptancePrior(min(0.95, max(0.05, mean)), self.initial.strength, self.initial.decay)

    def record(self, key: str, drafted: int, accepted: int) -> None:
        """Keep one request's acceptance rate (accepted / drafted tokens) when it drafted at least
        ``min_drafted`` tokens."""
        if drafted >= self.min_drafted:
            self._rates.setdefault(key, collections.deque(maxlen=self.size)).append(accepted / drafted)
