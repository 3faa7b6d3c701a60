"""Resting: during a run of plain steps, decide only as often as deciding pays for its own time.

A decision costs the engine time beside the forward: every drafter's offer, the controller's plan and the
hindsight that scores the offers against the emitted tokens. Beside a CPU's forward of tens of ms that is
nothing; beside a GPU's recorded step of a few ms it is a share a plain loop never pays, and when no drafter
pays (a useless draft, text that repeats nothing) every decision ends in a plain step anyway.

``RestSchedule``: after ``after`` plain decisions in a row (k = 0 for every row) the controller rests n steps
— plain steps with no offers, no decision, no hindsight and nothing learned — with n the fewest steps over
which the decision's time c_d stays within ``share`` of the plain steps' time (``rest_steps``), and at first
shorter: 1, 2, 4, … steps as the run of plain decisions grows (exponential back-off), so a pause between two
of a drafter's chances costs little and a stretch where nothing pays costs at most ``share``. A decision that
gives any row k > 0 ends the run. The price of a rest: a drafter's chance that opens during it waits up to
n steps. c_d is the median of the last ``window`` decisions' times as the engine measured them (or as a replay
prices them), once most of the window is in (a request's first decisions run cold); t_1 is the cost table's
1-token forward. Where c_d ≪ share · t_1 the controller never rests.
The rule is ours (amortising a fixed per-decision cost), not a paper's.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

REST_SHARE = 0.01  # in a run of plain steps, deciding may cost at most 1% of the plain steps' time
REST_AFTER = 2  # plain decisions in a row before the first rest
REST_MOST = 16  # the longest rest (steps): how long a drafter's chance may wait


def rest_steps(decision_ms: float, step_ms: float, share: float = REST_SHARE, most: int = REST_MOST) -> int:
    """n = min(most, ⌈c_d / (share · t_1)⌉ − 1): the fewest plain steps to rest after a decision so that its
    time ``decision_ms`` (c_d, ms) is at most ``share`` of the n + 1 steps' time (``step_ms`` = t_1 each, ms);
    0 where either time is not a positive finite number.

    Raises:
        ValueError: a share outside (0, 1] or a negative ``most``.
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share must be in (0, 1], got {share}")
    if most < 0:
        raise ValueError(f"most must be >= 0, got {most}")
    if not (math.isfinite(decision_ms) and math.isfinite(step_ms)) or decision_ms <= 0.0 or step_ms <= 0.0:
        return 0
    return min(most, max(0, math.ceil(decision_ms / (share * step_ms)) - 1))


class RestSchedule:
    """When the controller rests (see the module docstring): ``decided`` after each decided step's outcome,
    ``rests`` once per step, by the controller's ``decide`` before it asks for the step's view."""

    def __init__(
        self, share: float = REST_SHARE, after: int = REST_AFTER, most: int = REST_MOST, window: int = 5
    ) -> None:
        """Raises ValueError for ``after`` or ``window`` < 1 (and as ``rest_steps`` for share and most)."""
        if after < 1 or window < 1:
            raise ValueError(f"after and window must be >= 1, got {after} and {window}")
        rest_steps(1.0, 1.0, share, most)  # validates share and most
        self.share, self.after, self.most = share, after, most
        self._times: deque[float] = deque(maxlen=window)
        self._plain_run = 0
        self._left = 0

    def rests(self) -> bool:
        """True: the coming step rests (a plain step without a decision); counts it."""
        if self._left:
            self._left -= 1
            return True
        return False

    def decided(self, plain: bool, decision_ms: float, step_ms: float) -> None:
        """After a decision's step: ``plain`` whether every row made a plain step, ``decision_ms`` what the
        decision cost (ms; NaN: not measured, not counted), ``step_ms`` t_1 (ms; NaN: no cost model, no rest).
        The r-th plain decision in a row (r ≥ ``after``) sets a rest of min(2^(r − after), ``rest_steps``)."""
        if math.isfinite(decision_ms):
            self._times.append(decision_ms)
        self._plain_run = self._plain_run + 1 if plain else 0
        if self._plain_run >= self.after and len(self._times) > self._times.maxlen // 2:
            budget = rest_steps(statistics.median(self._times), step_ms, self.share, self.most)
            self._left = min(budget, 2 ** (self._plain_run - self.after))
