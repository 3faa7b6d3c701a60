"""Costs that follow the machine: realized step times against the cost table's predictions.

Design: a profile is measured once, on a machine that may have been quieter (or cooler) than the one
generating now. ``CostTracker`` keeps, per quantity — a verification forward at each width n (new tokens
per row), and the draft — an exponentially weighted mean and variance of r = log(realized / predicted)
over steps, across the requests of one pair and batch size. A quantity is corrected only once it has
drifted beyond noise: at least ``min_steps`` observations, and |mean| above both the dead band
(``log(1 + band)``) and two standard errors of the weighted mean; its factor is then exp(mean), else 1.
``corrected(table)`` scales the table: each verification width by its own factor (a width never seen takes
the nearest seen width's), the draft token and the catch-up by the draft's. The realized verification
time is everything after the proposal (forward, verification, bookkeeping), so the engine's own time is
priced too. Predictions are always those of the uncorrected table, so the factors do not feed back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .table import CostTable

VERIFY, DRAFT = "verify", "draft"


@dataclass
class Drift:
    """Exponentially weighted statistics of log(realized / predicted) for one quantity (weight of the
    newest observation ``weight``): mean, variance, observations, and Σw² / (Σw)² of the weights (the
    effective-sample-size term of the mean's standard error)."""

    mean: float = 0.0
    var: float = 0.0
    count: int = 0
    concentration: float = 1.0

    def add(self, value: float, weight: float) -> None:
        """One observation (a log ratio); the first one sets the mean."""
        w = 1.0 if self.count == 0 else weight
        delta = value - self.mean
        self.mean += w * delta
        self.var = (1.0 - w) * (self.var + w * delta * delta)
        self.concentration = w * w + (1.0 - w) ** 2 * self.concentration
        self.count += 1

    def factor(self, min_steps: int, band: float) -> float:
        """exp(mean) once drifted beyond noise (see the module docstring), else 1."""
        if self.count < min_steps:
            return 1.0
        error = math.sqrt(max(self.var, 0.0) * self.concentration)
        if abs(self.mean) <= max(math.log1p(band), 2.0 * error):
            return 1.0
        return math.exp(self.mean)


@dataclass
class CostTracker:
    """Realized vs predicted step times of one pair at one batch size → correction factors.

    weight: the newest observation's weight in the running means (0 < weight <= 1); min_steps: observations
    before a quantity may be corrected (>= 1); band: the relative drift always taken as noise (>= 0).

    Raises:
        ValueError: a parameter out of range.
    """

    weight: float = 0.05
    min_steps: int = 8
    band: float = 0.10
    drifts: dict[tuple[str, int], Drift] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1 or self.min_steps < 1 or self.band < 0:
            raise ValueError(f"CostTracker needs 0 < weight <= 1, min_steps >= 1 and band >= 0; got {self.weight}, "
                             f"{self.min_steps}, {self.band}")

    def observe(self, width: int, predicted: tuple[float, float], realized: tuple[float, float]) -> None:
        """One step: verification over ``width`` new tokens per row; ``predicted`` and ``realized``: its
        (draft, verification) times in ms, predicted by the uncorrected table. A time predicted as 0 (no
        paid drafter) or realized as 0 teaches nothing."""
        for key, p, r in (((DRAFT, 0), predicted[0], realized[0]), ((VERIFY, width), predicted[1], realized[1])):
            if p > 0 and r > 0 and math.isfinite(p) and math.isfinite(r):
                self.drifts.setdefault(key, Drift()).add(math.log(r / p), self.weight)

    def factors(self) -> dict[str, float]:
        """The corrections in force, by quantity ("draft", "verify@n"), factors different from 1 only."""
        out = {}
        for (name, width), drift in sorted(self.drifts.items()):
            f = drift.factor(self.min_steps, self.band)
            if f != 1.0:
                out[name if name == DRAFT else f"{name}@{width}"] = f
        return out

    def _verify_factor(self, width: int) -> float:
        seen = [w for name, w in self.drifts if name == VERIFY]
        if not seen:
            return 1.0
        nearest = min(seen, key=lambda w: (abs(w - width), w))
        return self.drifts[(VERIFY, nearest)].factor(self.min_steps, self.band)

    def corrected(self, table: CostTable) -> CostTable:
        """``table`` with each quantity scaled by its factor (the same table when nothing drifted)."""
        draft = self.drifts.get((DRAFT, 0))
        d = draft.factor(self.min_steps, self.band) if draft is not None else 1.0
        v = tuple(t * self._verify_factor(n) for n, t in enumerate(table.verify_ms, 1))
        if d == 1.0 and v == table.verify_ms:
            return table
        return replace(table, verify_ms=v, draft_ms=table.draft_ms * d, draft_catchup_ms=table.draft_catchup_ms * d)


@dataclass
class CostMemory:
    """The pair's trackers, one per (drafters' key, batch size), kept across requests."""

    trackers: dict[tuple[str, int], CostTracker] = field(default_factory=dict)

    def tracker_for(self, key: str, batch: int) -> CostTracker:
        return self.trackers.setdefault((key, batch), CostTracker())
