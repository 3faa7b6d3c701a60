"""Threads that follow the machine: the engine picks torch's intra-op thread count per step from the step
times it realizes.

Design: on a quiet CPU torch's threads (one per core) decode fastest; when another process holds a core,
each parallel op waits at its barrier for the thread that shares that core, and one thread can decode
faster than all of them. A cost profile, measured once, cannot say which holds now, so the engine measures.
``ThreadChooser`` keeps, per candidate count (the process's count when the chooser was made, and 1), a
running mean of log(realized / predicted) step time, the prediction being the controller's price of the
step as it ran, so steps of any width compare. It runs the candidate with the lower mean and, every
``EXPLORE_EVERY`` steps (the first time after ``EXPLORE_FIRST``), ``EXPLORE_STEPS`` steps on the other, where the
request can pay for them (``pick(explore=...)``: the slowdown ledger's slack covers a step more). One
chooser per model lives in its ``SpeculationState`` (its ``engine.owner.ModelState``'s, or one given per call),
across requests; torch's count is process-wide, set per step by the loop and restored by ``run_request`` when
the request ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EXPLORE_FIRST = 8  # steps before a candidate never timed is first tried
EXPLORE_EVERY = 128  # steps on the better count between two tries of the other
EXPLORE_STEPS = 3  # steps per try
WEIGHT = 0.2  # each step's weight in a candidate's running mean, once 5 steps are seen


@dataclass
class ThreadChooser:
    """Which thread count runs the next step. ``counts``: the candidates, the default first.

    Raises:
        ValueError: no candidate, or a count that is not an integer >= 1.
    """

    counts: tuple[int, ...]
    means: dict[int, float] = field(default_factory=dict)  # log(realized / predicted) per count
    seen: dict[int, int] = field(default_factory=dict)
    since: int = 0  # steps on the better count since the last try
    trying: int = 0  # steps left in the current try

    def __post_init__(self) -> None:
        if not self.counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.counts):
            raise ValueError(f"thread counts must be integers >= 1, got {self.counts}")

    @classmethod
    def for_threads(cls, threads: int) -> ThreadChooser:
        """The chooser between ``threads`` (torch's count) and 1."""
        return cls((threads, 1) if threads > 1 else (threads,))

    @property
    def best(self) -> int:
        """The count with the lowest mean of those timed (the default until another is timed)."""
        timed = [c for c in self.counts if self.seen.get(c)]
        return min(timed, key=lambda c: self.means[c]) if timed else self.counts[0]

    def pick(self, explore: bool = True) -> int:
        """The count for the next step: the best, or the other one during a try; with ``explore`` False no
        try starts or goes on (the request cannot pay for one now), and a due try waits."""
        best = self.best
        others = [c for c in self.counts if c != best]
        if not others:
            return best
        other = min(others, key=lambda c: self.seen.get(c, 0))
        due = EXPLORE_FIRST if not self.seen.get(other) else EXPLORE_EVERY
        if not explore:
            self.trying = 0
        elif not self.trying and self.since >= due:
            self.trying, self.since = EXPLORE_STEPS, 0
        if self.trying:
            self.trying -= 1
            return other
        self.since += 1
        return best

    def observe(self, count: int, realized_ms: float, predicted_ms: float) -> None:
        """One step's realized and predicted time (ms) on ``count`` threads; other values are ignored."""
        if count not in self.counts or not (0 < realized_ms < math.inf and 0 < predicted_ms < math.inf):
            return  # NaN fails every comparison
        n = self.seen[count] = self.seen.get(count, 0) + 1
        x = math.log(realized_ms / predicted_ms)
        self.means[count] = x if n == 1 else self.means[count] + max(WEIGHT, 1.0 / n) * (x - self.means[count])
