"""The slowdown ledger: speculation never costs a request more than a stated share over plain decoding.

The bound (per request, any batch size; for B = 1 the tokens are the row's own): with T the request's decoding
time (every step after the prefill, as the engine measured it) and P its plain counterfactual — each plain step's
own time, and t_1 for each plain step's worth of tokens a speculative step emitted (the fewest any row emitted),
t_1 being the request's recent plain step (``plain_step_ms``) — T ≤ (1 + ε)·P + t_s, with t_s the time of the
longest step the request took and ε ``SpeculationConfig.max_slowdown``. A plain step is its own counterfactual, so
what slows every step alike (another process, a thread count tried) moves T and P together.

How it is kept, by construction (conservative exploration: Wu, Shariff, Lattimore and Szepesvári, "Conservative
Bandits", ICML 2016, §3; Kazerouni et al., "Conservative Contextual Linear Bandits", NeurIPS 2017): the ledger
books every step's realized time and its counterfactual, so its slack S = (1 + ε)·P − T is what the request may
still spend beyond plain decoding. A speculative action of predicted time c (draft tokens, the draft's catch-up,
the verification) is taken only while the slack is non-negative and its pessimistic outcome keeps it so: S +
(1+ε)·t_1·n_lo − c ≥ 0 (``admissible``), with n_lo a lower confidence bound on the plain steps' worth of tokens it
emits (1 + the acceptance models' ``floor`` path, ≥ 1). A step emits at least one token, so the slack can fall
below zero only through the step just admitted, by at most that step's time; a plain step adds ε of its time, so
the request then decodes plainly until the slack is earned back. Exploration is paid from the slack alone: a
drafter whose n_lo is still low (a new pair's draft) is tried once plain steps or other drafters' gains have
earned its pessimistic cost. What speculation gains (tokens beyond n_lo, at less than t_1 each) widens the slack,
so a drafter that pays keeps drafting, and what a request learns (the draft's calibration, prompt lookup's
acceptance) raises the next request's n_lo. Where the cost model is wrong the realized times correct the slack at
the next step, and predicted times are put on the realized clock by the median ratio of the request's realized to
predicted step times (``scale``; a cost table measured on another machine, or under another load, still prices
actions relative to each other).
"""

from __future__ import annotations

import bisect
import math
from collections import deque

from ..config import check_slowdown

SLACK_TOLERANCE_MS = 1e-9  # a slack this far below zero is zero (rounding of sums of ms)
WINDOW = 16  # the request's last steps whose median gives t_1 (plain ones) and the realized/predicted scale


def admissible(slack_ms: float, credit_ms: float, cost_ms: float, floor_tokens: float) -> bool:
    """S ≥ 0 and S + credit·n_lo − c ≥ 0: whether an action predicted to take ``cost_ms`` and to emit at least
    ``floor_tokens`` plain steps' worth keeps the ledger's slack ``slack_ms`` non-negative, each such step
    credited ``credit_ms`` = (1 + ε)·t_1 (all ms; the module docstring)."""
    return math.isinf(slack_ms) or (
        slack_ms >= -SLACK_TOLERANCE_MS and slack_ms + credit_ms * floor_tokens - cost_ms >= -SLACK_TOLERANCE_MS
    )


class Ledger:
    """One request's slowdown ledger (module docstring): ``book`` after every step, ``admits`` before a
    speculative action. ``epsilon``: ε ≥ 0; ``t1_ms``: the cost model's plain step (ms; on the realized
    clock, t_1 until the request has made plain steps of its own).

    Raises:
        ValueError: ε not a number ≥ 0, or t1_ms not a positive finite time.
    """

    def __init__(self, epsilon: float, t1_ms: float) -> None:
        check_slowdown(epsilon)
        if not (math.isfinite(t1_ms) and t1_ms > 0):
            raise ValueError(f"t1_ms must be a positive time in ms, got {t1_ms}")
        self.epsilon, self.seed_ms = epsilon, t1_ms
        self.spent_ms = 0.0
        self.counterfactual_ms = 0.0
        self._plain, self._ratios = _Window(WINDOW), _Window(WINDOW)
        self._t1_ms, self._scale = math.nan, 1.0  # the medians, taken once per booked step (best_plan asks often)

    @property
    def scale(self) -> float:
        """Realized over predicted step time: the median over the request's last steps (1 before any)."""
        return self._scale

    @property
    def plain_step_ms(self) -> float:
        """t_1 (ms): the median of the request's last plain steps as booked, else the cost model's (scaled)."""
        return self._t1_ms if self._plain else self.seed_ms * self._scale

    @property
    def credit_ms(self) -> float:
        """(1 + ε)·t_1: what one plain step's worth of tokens allows the request to spend (ms)."""
        return (1.0 + self.epsilon) * self.plain_step_ms

    @property
    def slack_ms(self) -> float:
        """S = (1 + ε)·P − T (ms); inf without a bound."""
        if math.isinf(self.epsilon):
            return math.inf
        return (1.0 + self.epsilon) * self.counterfactual_ms - self.spent_ms

    def admits(self, cost_ms: float, floor_tokens: float) -> bool:
        """Whether an action of predicted time ``cost_ms`` (ms, the cost model's; put on the realized clock
        by ``scale``) and at least ``floor_tokens`` tokens per row keeps the slack non-negative
        (``admissible``)."""
        return admissible(self.slack_ms, self.credit_ms, cost_ms * self.scale, floor_tokens)

    def book(self, elapsed_ms: float, emitted: int, plain: bool, predicted_ms: float = math.nan) -> None:
        """One step: its time (ms), the fewest tokens a row emitted (the plain steps it stood for), whether
        it was plain (its time is then its own counterfactual and a sample of t_1; a speculative step's is
        t_1 per plain step it stood for) and its predicted time (ms; NaN: not predicted).

        Raises:
            ValueError: a negative or non-finite time, or fewer than one token.
        """
        if not (math.isfinite(elapsed_ms) and elapsed_ms >= 0) or emitted < 1:
            raise ValueError(f"a step takes a finite time >= 0 and emits >= 1 token, got {elapsed_ms}, {emitted}")
        self.counterfactual_ms += elapsed_ms if plain else self.plain_step_ms * emitted
        self.spent_ms += elapsed_ms
        if plain:
            self._t1_ms = self._plain.add(elapsed_ms)
        if math.isfinite(predicted_ms) and predicted_ms > 0:
            self._scale = self._ratios.add(elapsed_ms / predicted_ms)


class _Window:
    """The last ``size`` values in arrival order and sorted: ``add`` is O(size) with no sort, and returns the
    median as ``statistics.median`` gives it (the mean of the middle two for an even count)."""

    def __init__(self, size: int) -> None:
        self.order: deque[float] = deque(maxlen=size)
        self.sorted: list[float] = []

    def __bool__(self) -> bool:
        return bool(self.order)

    def add(self, value: float) -> float:
        if len(self.order) == self.order.maxlen:
            del self.sorted[bisect.bisect_left(self.sorted, self.order[0])]
        self.order.append(value)
        bisect.insort(self.sorted, value)
        n = len(self.sorted)
        return self.sorted[n // 2] if n % 2 else (self.sorted[n // 2 - 1] + self.sorted[n // 2]) / 2
