"""Online correction of the cost table: each step's realized time against the table's prediction.

A measured table (``CostTable``, from the profile or a calibration) can still be off where it counts.
A profile's fitted line can miss a regime: on the Qwen pair's Spec-Bench runs (README, Benchmark),
draft tokens took 1.56–2.25x what the profile's fit predicts at contexts below 128 tokens. A real
step also does work a timed forward does not: logits processing, the draft's softmax, verification,
cache rollback, Python.
So the engine reports every step's realized draft and verification time, and ``CostTracker`` keeps
one ratio per role, of exponentially decayed sums with a prior at 1:

    s = (Σ_i λ^i · realized_i + w) / (Σ_i λ^i · predicted_i + w)      (i = 0: the latest step)

- verification: realized verify ms against t_verify(k+1), every step (plain steps included);
- each draft model: realized draft ms against k·t_draft, on steps that drafted with it and had no
  catch-up (the catch-up's cost per token stays as measured).
With ``adapt_costs`` the controller's costs are the table's times these ratios; without it (the
default in ``generate``) the ratios are only measured and reported. w is two steps' worth of the
predicted cost (2·t_verify(1), 2·t_draft), so one slow step moves a ratio by a fraction only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from .costs import CostTable, DrafterCosts


@dataclass(frozen=True)
class CostScale:
    """Realized / predicted time ratios: ``verify`` for the target's forward, ``draft`` per drafter."""

    verify: float = 1.0
    draft: tuple[float, ...] = ()


class DecayedRatio:
    """(Σ λ^i·realized_i + start·w) / (Σ λ^i·predicted_i + w): a ratio of decayed sums, ``start``
    before any data."""

    def __init__(self, decay: float, prior: float, start: float = 1.0) -> None:
        if not 0.0 <= decay < 1.0 or prior <= 0 or start <= 0:
            raise ValueError(f"decay must be in [0, 1), prior and start > 0, got {decay}, {prior}, {start}")
        self.decay, self.prior, self.start, self.realized, self.predicted = decay, prior, start, 0.0, 0.0

    def add(self, realized_ms: float, predicted_ms: float) -> None:
        """Fold in one step's realized and predicted time (ms)."""
        self.realized = self.decay * self.realized + realized_ms
        self.predicted = self.decay * self.predicted + predicted_ms

    @property
    def value(self) -> float:
        """The current ratio (dimensionless); exactly ``start`` before any data."""
        if self.predicted == 0.0:
            return self.start
        return (self.realized + self.start * self.prior) / (self.predicted + self.prior)


def scaled_costs(costs: CostTable, drafters: Sequence[DrafterCosts], scale: CostScale
                 ) -> tuple[CostTable, tuple[DrafterCosts, ...]]:
    """The table with every verify time × ``scale.verify`` and each drafter's token cost × its ratio."""
    table = replace(costs, verify_ms=tuple(t * scale.verify for t in costs.verify_ms))
    return table, tuple(replace(d, draft_ms=d.draft_ms * s) for d, s in zip(drafters, scale.draft, strict=True))


class CostTracker:
    """Live costs for a controller: the measured table corrected by realized step times, starting
    from ``start`` (e.g. the ratios a previous request ended with; None: 1)."""

    def __init__(self, costs: CostTable, drafters: Sequence[DrafterCosts], decay: float = 0.9,
                 start: CostScale | None = None) -> None:
        self.base, self.base_drafters = costs, tuple(drafters)
        draft_start = start.draft if start is not None and len(start.draft) == len(drafters) else (1.0,) * len(drafters)
        self._verify = DecayedRatio(decay, 2.0 * costs.t_verify(1), start.verify if start is not None else 1.0)
        self._draft = [DecayedRatio(decay, 2.0 * d.draft_ms, s) if d.draft_ms > 0 else None
                       for d, s in zip(self.base_drafters, draft_start, strict=True)]
        self._scaled: tuple[CostTable, tuple[DrafterCosts, ...]] | None = None  # built when first read

    @property
    def costs(self) -> CostTable:
        """The table corrected by the current ratios (ms)."""
        return self._corrected()[0]

    @property
    def drafters(self) -> tuple[DrafterCosts, ...]:
        """Per-drafter costs corrected by the current ratios (ms)."""
        return self._corrected()[1]

    def _corrected(self) -> tuple[CostTable, tuple[DrafterCosts, ...]]:
        if self._scaled is None:
            self._scaled = scaled_costs(self.base, self.base_drafters, self.scale)
        return self._scaled

    @property
    def scale(self) -> CostScale:
        """The current ratios (1.0 for a drafter that costs nothing, or before any data)."""
        return CostScale(self._verify.value, tuple(r.value if r else 1.0 for r in self._draft))

    def observe(self, drafter: int, drafted: int, catchup_tokens: int, draft_ms: float, verify_ms: float) -> None:
        """Fold in one step: ``drafted`` tokens from ``drafter`` (0: a plain step) after ingesting
        ``catchup_tokens``, taking ``draft_ms`` to propose and ``verify_ms`` to verify (ms)."""
        self._verify.add(verify_ms, self.base.t_verify(drafted + 1))
        ratio = self._draft[drafter]
        if drafted and catchup_tokens == 0 and ratio is not None:
            ratio.add(draft_ms, drafted * self.base_drafters[drafter].draft_ms)
        self._scaled = None


class TrackedCosts:
    """Controller mixin: the engine reports each step's times through ``observe_time`` to a
    ``CostTracker``, which always measures the ratios; ``costs`` and ``drafters`` are its corrected
    costs when ``adapt_costs`` is set, else the table's as measured."""

    tracker: CostTracker
    adapt_costs: bool = False

    def _track_costs(self, costs: CostTable, drafters: Sequence[DrafterCosts], adapt_costs: bool) -> None:
        self.tracker, self.adapt_costs = CostTracker(costs, drafters), adapt_costs

    @property
    def costs(self) -> CostTable:
        """The cost table in use (ms): as measured, or corrected online."""
        return self.tracker.costs if self.adapt_costs else self.tracker.base

    @property
    def drafters(self) -> tuple[DrafterCosts, ...]:
        """Per-drafter costs in use (ms), in drafter order."""
        return self.tracker.drafters if self.adapt_costs else self.tracker.base_drafters

    def resume_costs(self, scale: CostScale) -> None:
        """Start the correction from ``scale`` (the ratios a previous request of this pair ended with)."""
        self.tracker = CostTracker(self.tracker.base, self.tracker.base_drafters, start=scale)

    def observe_time(self, drafter: int, drafted: int, catchup_tokens: int, draft_ms: float, verify_ms: float) -> None:
        """``CostTracker.observe``: the ratios are measured whether or not they are applied."""
        self.tracker.observe(drafter, drafted, catchup_tokens, draft_ms, verify_ms)


class CostScaleMemory:
    """The last ``CostScale`` per pair key (``CostTable.key``), so a new request starts corrected."""

    def __init__(self) -> None:
        self._scales: dict[str, CostScale] = {}

    def scale_for(self, key: str) -> CostScale | None:
        """The ratios the pair's last request ended with; None before its first."""
        return self._scales.get(key)

    def record(self, key: str, scale: CostScale) -> None:
        """Remember ``scale`` for the pair ``key``."""
        self._scales[key] = scale
