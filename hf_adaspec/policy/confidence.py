"""The draft's calibrated confidence: how likely a drafted prefix is to be accepted (AdaSpec, arXiv 2503.05096).

Notation: p = target distribution, q = draft distribution. While drafting, a row keeps the draft's
confidence in its proposal so far, c_j = Π_{u≤j} q(x_u) (the running product of the draft's
probabilities of its own tokens). An online, per-pair calibration maps c_j to the observed probability
that the whole prefix of j drafted tokens is accepted, P_j = P(prefix j accepted | c_j). The controller
prices a draft along the predicted path ĉ_j = c̄^j (c̄: the row's running mean per-token confidence) and,
while drafting, predicts the next token's ĉ_{j+1} = c_j·c̄ (``policy.goodput.draft_next_column`` decides).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence


def isotonic(values: Sequence[float], weights: Sequence[float]) -> tuple[float, ...]:
    """Weighted least-squares non-decreasing fit by pool-adjacent-violators (Ayer et al. 1955).

    Adjacent values that violate the order are pooled into their weighted mean until none does.

    Raises:
        ValueError: lengths differ or a weight is not > 0.
    """
    if len(values) != len(weights):
        raise ValueError(f"values and weights differ in length: {len(values)} != {len(weights)}")
    if any(not w > 0 for w in weights):
        raise ValueError(f"weights must be > 0, got {list(weights)}")
    blocks: list[tuple[float, float, int]] = []  # (mean, weight, values pooled)
    for v, w in zip(values, weights):
        blocks.append((float(v), float(w), 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, n2), (m1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append(((m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2))
    return tuple(mean for mean, _, count in blocks for _ in range(count))


PESSIMISM = 4.0  # a lower confidence bound is the rate less this many standard errors (the slowdown ledger's)


def shifted_rate(rate: float, trials: float, z: float) -> float:
    """rate + z·√(rate(1 − rate)/(trials + 1)), clamped to [0, 1]: an upper (z > 0) or lower (z < 0)
    confidence bound on a Bernoulli rate seen over ``trials``."""
    rate = min(1.0, max(0.0, rate))
    return min(1.0, max(0.0, rate + z * math.sqrt(rate * (1.0 - rate) / (trials + 1.0))))


def prefix_confidences(confidences: Sequence[float]) -> tuple[float, ...]:
    """c_j = Π_{u≤j} q(x_u) for j = 1..k, from the per-token confidences q(x_1..x_k)."""
    return tuple(math.prod(confidences[: j + 1]) for j in range(len(confidences)))


def interpolate_bins(centres: Sequence[float], values: Sequence[float], x: float) -> float:
    """Piecewise-linear interpolation of per-bin ``values`` at bin ``centres`` (increasing), constant
    beyond the first and last centre."""
    if x <= centres[0]:
        return values[0]
    if x >= centres[-1]:
        return values[-1]
    b = bisect.bisect_right(centres, x) - 1  # centres[b] ≤ x < centres[b+1]
    t = (x - centres[b]) / (centres[b + 1] - centres[b])
    return values[b] + t * (values[b + 1] - values[b])


class ConfidenceCalibrator:
    """Online, binned map from cumulative confidence c ∈ [0, 1] to P(prefix of j drafts accepted).

    ``n_bins`` equal bins over [0, 1] count trials and successes, each starting with ``prior_strength``
    pseudo-trials at the identity calibration (P = c at the bin centre); the per-bin rates are made
    non-decreasing by ``isotonic``. Predictions are optimistic under uncertainty: each bin's rate plus
    ``optimism`` standard errors, √(P(1−P)/(n+1)) for n trials (an upper confidence bound), made
    non-decreasing again by ``isotonic`` weighted by trials, and interpolated linearly between bin
    centres. Without it a pessimistic start predicts that drafting never pays, and since only drafted
    tokens are observed the calibration would never learn otherwise (docs/experiments.md, row "Confidence
    calibration predicts an upper confidence bound"); the bonus shrinks as 1/√n, so a well-observed bin
    predicts its observed rate. It also keeps the pair's running mean per-token confidence
    (``token_mean``), the seed of each new row's c̄. One calibrator per (target, drafter) pair, kept across
    requests (``CalibratorMemory``).
    """

    def __init__(
        self, n_bins: int = 10, prior_strength: float = 2.0, token_mean: float = 0.7, optimism: float = 1.0
    ) -> None:
        if n_bins < 1 or prior_strength <= 0 or not 0.0 <= token_mean <= 1.0 or optimism < 0:
            raise ValueError(
                f"need n_bins >= 1, prior_strength > 0, token_mean in [0, 1], optimism >= 0; "
                f"got {n_bins}, {prior_strength}, {token_mean}, {optimism}"
            )
        self.centres = tuple((b + 0.5) / n_bins for b in range(n_bins))
        self.prior_strength = prior_strength
        self.trials = [prior_strength] * n_bins
        self.successes = [prior_strength * c for c in self.centres]
        self.token_mean, self.tokens_seen, self.optimism = token_mean, 0, optimism
        self._refit()

    def _refit(self) -> None:
        """Isotonic rates per bin, then their upper bounds made non-decreasing (weighted by trials), ≤ 1."""
        rates = isotonic([s / t for s, t in zip(self.successes, self.trials)], self.trials)
        upper = [shifted_rate(r, n, self.optimism) for r, n in zip(rates, self.trials)]
        self._fitted = isotonic(upper, self.trials)  # weighted: a rarely seen bin cannot lift a well-seen one
        seen = [max(0.0, n - self.prior_strength) for n in self.trials]  # observed trials, without the prior's
        hits = [max(0.0, s - self.prior_strength * c) for s, c in zip(self.successes, self.centres)]
        self._floor = isotonic(
            [shifted_rate(h / n, n, -PESSIMISM) if n else 0.0 for h, n in zip(hits, seen)], [n + 1e-3 for n in seen]
        )  # a floor rests on observations alone

    def _bin(self, c: float) -> int:
        return min(int(c * len(self.centres)), len(self.centres) - 1)

    def predict(self, c: float) -> float:
        """P(prefix accepted | cumulative confidence c): its upper confidence bound, non-decreasing in c.

        Raises:
            ValueError: c outside [0, 1].
        """
        if not 0.0 <= c <= 1.0:
            raise ValueError(f"confidence must be in [0, 1], got {c}")
        return interpolate_bins(self.centres, self._fitted, c)

    def predict_lower(self, c: float) -> float:
        """P(prefix accepted | cumulative confidence c): its lower confidence bound, from the observed
        prefixes alone (each bin's observed rate less ``PESSIMISM`` standard errors; 0 where none was
        observed), non-decreasing in c. Raises ValueError for c outside [0, 1]."""
        if not 0.0 <= c <= 1.0:
            raise ValueError(f"confidence must be in [0, 1], got {c}")
        return interpolate_bins(self.centres, self._floor, c)

    def update(self, confidences: Sequence[float], accepted: int) -> None:
        """Record one verified proposal: q(x_1..x_k) of its k drafted tokens, ``accepted`` n ≤ k.

        The prefix of j tokens was accepted iff j ≤ n: positions j ≤ n are successes, every j > n a
        failure (its prefix contains the rejected token n+1), so every drafted prefix is observed.

        Raises:
            ValueError: accepted outside [0, k].
        """
        if not 0 <= accepted <= len(confidences):
            raise ValueError(f"accepted must be in [0, {len(confidences)}], got {accepted}")
        for j, c in enumerate(prefix_confidences(confidences), start=1):
            b = self._bin(c)
            self.trials[b] += 1.0
            self.successes[b] += 1.0 if j <= accepted else 0.0
        for q in confidences:
            self.tokens_seen += 1
            self.token_mean += (q - self.token_mean) / (self.tokens_seen + 1)  # the seed counts as one token
        self._refit()


class CalibratorMemory:
    """One ``ConfidenceCalibrator`` per drafter key (a (target, drafter) pair), kept across requests."""

    def __init__(self, factory: Callable[[], ConfidenceCalibrator] = ConfidenceCalibrator) -> None:
        self.factory = factory
        self._calibrators: dict[str, ConfidenceCalibrator] = {}

    def calibrator_for(self, key: str) -> ConfidenceCalibrator:
        """The pair's calibrator, created on first use."""
        if key not in self._calibrators:
            self._calibrators[key] = self.factory()
        return self._calibrators[key]


class RunningMean:
    """Mean of the observed values, seeded with ``seed`` worth ``weight`` observations."""

    def __init__(self, seed: float, weight: float = 4.0) -> None:
        self.value, self.weight = seed, weight

    def add(self, x: float) -> None:
        """Fold in one observation."""
        self.weight += 1.0
        self.value += (x - self.value) / self.weight
