"""The target's own confidence as a signal of how well the draft would do, on steps that do not draft.

Notation: p = target distribution, q = draft distribution. A controller that takes plain steps learns
nothing about the draft from them: only drafted tokens are verified. But every step's verification
yields p at each kept position, and where the target is sure of its next token (p_max near 1: code,
arithmetic, copied text) the draft tends to agree with it and to be sure too. ``TargetConfidenceMap``
learns, per (target, draft) pair and online, the mean of a quantity y at a drafted position given
the target's top probability p_max there: y = q(x_u) for the confidence controller, which on a step
without the draft folds the predicted q into its request's mean confidence c̄ (``confidence``);
y = 1 if the token was accepted, else 0, for the goodput controller, which adds the predicted
acceptance to the draft's α as a soft trial (``controller``). Only positions that verified a draft
token on an accepted prefix are learned from (the first n+1 of k for n accepted): after a rejection
p is conditioned on a text the target did not write.
Opt-in (``target_confidence=True``): on Spec-Bench it made the controllers draft more (mean k 0.89 →
0.99 for confidence under the profile's costs, 0.31 → 0.51 with online cost correction) but not
faster (README, Benchmark).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence


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


class TargetConfidenceMap:
    """Online binned mean of y ∈ [0, 1] (the draft's q(x_u), or whether x_u was accepted) given the
    target's p_max at the same position.

    ``n_bins`` equal bins over [0, 1], each starting with ``prior_strength`` pseudo-observations at the
    identity (y = p_max at the bin centre); predictions interpolate linearly between bin centres.
    """

    def __init__(self, n_bins: int = 10, prior_strength: float = 2.0) -> None:
        if n_bins < 1 or prior_strength <= 0:
            raise ValueError(f"need n_bins >= 1 and prior_strength > 0, got {n_bins}, {prior_strength}")
        self.centres = tuple((b + 0.5) / n_bins for b in range(n_bins))
        self.weights = [prior_strength] * n_bins
        self.sums = [prior_strength * c for c in self.centres]

    def update(self, target_top: Sequence[float], ys: Sequence[float]) -> None:
        """Fold in pairs (p_max, y) of positions that verified a drafted token.

        Raises:
            ValueError: lengths differ, or a value outside [0, 1].
        """
        if len(target_top) != len(ys):
            raise ValueError(f"target_top and ys differ in length: {len(target_top)} != {len(ys)}")
        for p, y in zip(target_top, ys):
            if not (0.0 <= p <= 1.0 and 0.0 <= y <= 1.0):
                raise ValueError(f"values must be in [0, 1], got p_max={p}, y={y}")
            b = min(int(p * len(self.centres)), len(self.centres) - 1)
            self.weights[b] += 1.0
            self.sums[b] += y

    def predict(self, p: float) -> float:
        """Expected y where the target's top probability is ``p``.

        Raises:
            ValueError: p outside [0, 1].
        """
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"target top probability must be in [0, 1], got {p}")
        return interpolate_bins(self.centres, [s / w for s, w in zip(self.sums, self.weights)], p)


def judged_positions(drafted: int, accepted: int) -> int:
    """How many leading verified positions judged a drafted token on an accepted prefix: min(n+1, k)."""
    return min(accepted + 1, drafted)
