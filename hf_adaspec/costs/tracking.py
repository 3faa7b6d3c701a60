"""Costs that follow the machine: a profile's prices corrected by the step times the engine realizes.

Design: a profile (or a calibration) is measured once, on a quiet machine. Later the machine runs a
browser, another job, or throttles, and each forward slows, not uniformly: a draft model's small forwards
and a target's large ones suffer differently from a busy core, and a profile ages unevenly across widths. The controller's objective
(expected tokens per ms of step time, SmartSpec arXiv 2406.14066 §4.2) is unchanged by a uniform factor,
so what moves decisions is the drift of one quantity against another.

``CostTracker`` learns from each step's whole time (draft + verification), since the split between the
two phases is not where the time goes: under load a draft forward leaves part of its cost to the forward
after it. Steps without a paid drafter (plain, prompt lookup, suffix drafting) teach verification: running
means (weight ``WEIGHT``) of log(realized / priced), pooled over widths and per width n = k + 1. Steps with
the draft model teach the draft token: running sums of what the step took beyond its verification at the
corrected price, against the draft's price; not from steps dominated by a prompt's catch-up (more
catch-up than drafted tokens), which is priced per token and would teach the draft a wrong price.
``corrected`` multiplies the profile's ``CostTable`` by the factors, each shrunk toward no change (the
draft's: toward verification's pooled factor) by its evidence n / (n + ``PRIOR_STEPS``); a width not yet
seen takes the pooled factor. The draft's evidence ages by ``DECAY`` per step without it, so a drafter
priced out is priced back in by the profile and measured again.
``CostMemory`` keeps one tracker per cost table's key (the model pair), across requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .table import CostTable

WEIGHT = 0.05  # each step's weight in the running means, once 20 steps are seen
PRIOR_STEPS = 8.0  # a factor seen n times moves n / (n + PRIOR_STEPS) of the way to its mean
DECAY = 0.01  # per step without a draft observation, the draft's evidence ages by 1%
FLOOR = 0.05  # the draft's realized share is taken as at least this fraction of its price


@dataclass
class LogRatio:
    """Running mean of log(realized / priced) over ``n`` observations (weight max(WEIGHT, 1/n))."""

    mean: float = 0.0
    n: int = 0

    def add(self, x: float) -> None:
        self.n += 1
        self.mean += max(WEIGHT, 1.0 / self.n) * (x - self.mean)

    @property
    def shrink(self) -> float:
        """How far the factor moves toward the mean: n / (n + PRIOR_STEPS), in [0, 1)."""
        return self.n / (self.n + PRIOR_STEPS)


@dataclass(frozen=True)
class StepTiming:
    """One step's times (ms) as the uncorrected costs price it and as realized, at verification width n
    (new tokens per row), with the paid drafters' ``draft_tokens`` and ``catchup_tokens`` (0: none drafted)."""

    width: int
    priced_draft_ms: float
    priced_verify_ms: float
    realized_draft_ms: float
    realized_verify_ms: float
    draft_tokens: int
    catchup_tokens: int


def _log_ratio(realized: float, priced: float) -> float | None:
    """log(realized / priced), None when either is not a positive finite time."""
    if not (math.isfinite(realized) and math.isfinite(priced) and realized > 0 and priced > 0):
        return None
    return math.log(realized / priced)


@dataclass(frozen=True)
class CostFactors:
    """What the tracker multiplies the priced costs by: ``verify[n-1]`` at n new tokens per row, ``draft``
    per draft and catch-up token, learned from ``steps`` timed steps of the pair (1: no drift seen)."""

    verify: tuple[float, ...]
    draft: float
    steps: int

    def describe(self) -> str:
        """One line, e.g. "verification x1.82 (1 token) to x1.64 (9 tokens), draft x1.10, from 412 steps"."""
        v, n = self.verify, len(self.verify)
        return (f"verification x{v[0]:.2f} (1 token) to x{v[-1]:.2f} ({n} tokens), draft x{self.draft:.2f}, "
                f"from {self.steps} steps")


@dataclass
class DraftShare:
    """Running sums (weight max(WEIGHT, 1/n)) of the draft's realized ms (a step's time beyond its corrected
    verification) and its priced ms; ``evidence``: observations, aged by ``DECAY`` per step without one."""

    realized: float = 0.0
    priced: float = 0.0
    n: int = 0
    evidence: float = 0.0

    def add(self, realized: float, priced: float) -> None:
        self.n += 1
        w = max(WEIGHT, 1.0 / self.n)
        self.realized += w * (realized - self.realized)
        self.priced += w * (priced - self.priced)
        self.evidence += 1.0

    @property
    def log_ratio(self) -> float:
        return math.log(max(self.realized, FLOOR * self.priced) / self.priced) if self.priced > 0 else 0.0


@dataclass
class CostTracker:
    """Verification's and the draft token's drift from the priced costs, learned from ``StepTiming``s."""

    verify: LogRatio = field(default_factory=LogRatio)
    widths: dict[int, LogRatio] = field(default_factory=dict)
    draft: DraftShare = field(default_factory=DraftShare)

    def observe(self, t: StepTiming) -> None:
        """Learn from one step; times that are not positive and finite are ignored."""
        total = t.realized_draft_ms + t.realized_verify_ms
        paid = t.draft_tokens > 0 or t.catchup_tokens > 0
        if not paid:
            x = _log_ratio(total, t.priced_verify_ms)
            if x is not None:
                self.verify.add(x)
                self.widths.setdefault(t.width, LogRatio()).add(x)
        clean = t.draft_tokens > 0 and t.catchup_tokens <= t.draft_tokens and t.priced_draft_ms > 0
        if clean and math.isfinite(total) and total > 0:
            self.draft.add(total - t.priced_verify_ms * self.verify_factor(t.width), t.priced_draft_ms)
        else:
            self.draft.evidence *= 1.0 - DECAY

    def _pooled(self) -> float:
        return self.verify.mean * self.verify.shrink

    def verify_factor(self, width: int) -> float:
        """Multiplier of the priced verification over ``width`` new tokens (1: no drift seen)."""
        own = self.widths.get(width)
        deviation = (own.mean - self.verify.mean) * own.shrink if own is not None else 0.0
        return math.exp(self._pooled() + deviation)

    @property
    def draft_factor(self) -> float:
        """Multiplier of the priced draft token and catch-up token (verification's pooled factor until the
        draft is seen)."""
        shrink = self.draft.evidence / (self.draft.evidence + PRIOR_STEPS)
        return math.exp(self._pooled() + (self.draft.log_ratio - self._pooled()) * shrink)

    def factors(self, n_max: int) -> CostFactors:
        """The factors at widths 1..n_max."""
        return CostFactors(tuple(self.verify_factor(n) for n in range(1, n_max + 1)), self.draft_factor,
                           self.verify.n + self.draft.n)

    def corrected(self, costs: CostTable) -> CostTable:
        """``costs`` times the learned factors (the same table when nothing was observed)."""
        if not self.verify.n and not self.draft.n:
            return costs
        verify = tuple(t * self.verify_factor(n) for n, t in enumerate(costs.verify_ms, start=1))
        f = self.draft_factor
        return replace(costs, verify_ms=verify, draft_ms=costs.draft_ms * f, draft_catchup_ms=costs.draft_catchup_ms * f)


@dataclass
class CostMemory:
    """One ``CostTracker`` per cost table key (the model pair's), kept across requests."""

    trackers: dict[str, CostTracker] = field(default_factory=dict)

    def tracker(self, key: str) -> CostTracker:
        return self.trackers.setdefault(key, CostTracker())
