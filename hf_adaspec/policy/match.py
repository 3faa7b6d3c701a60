"""Prompt lookup's acceptance, priced by its match length and learned from every step (hindsight).

Notation: p = target, q = draft. A prompt-lookup proposal copies the tokens that followed an earlier
occurrence of the sequence's last tokens; ``m`` = how many tokens before the proposal match that
occurrence (its match length). Model: token u of a proposal is accepted with probability α(m + u − 1)
once its predecessors were (each accepted token extends the match by one), so P_j = Π_{u≤j} α(m+u−1);
the per-token rate α(·) rises with the match length (a long copied run tends to go on). ``MatchTable``
keeps, per match-length bucket, discounted Beta counts of per-token trials, pooled over the pair's
requests (``MatchMemory``, kept in the learned state) and made non-decreasing in m (``isotonic``).
Lookup costs no forward, so every step scores what it would have proposed against the tokens the step
emitted (hindsight): exact under greedy decoding, and unbiased under sampling (a copied token x is
emitted with probability p(x), the probability that verification would accept it). So the estimate
never waits for lookup to be chosen, which a pessimistic rate learned only when chosen never is.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from .confidence import PESSIMISM, isotonic, shifted_rate

# bucket b holds match lengths in [EDGES[b], EDGES[b+1]); the last is open
EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)

# A new pair's per-token α for a costless drafter at every match length, until hindsight teaches its
# ``MatchTable``: the upper quartile of prompt lookup's per-request acceptance (accepted / drafted tokens)
# on Spec-Bench prompts (docs/experiments.md, the lookup start).
LOOKUP_START_ALPHA = 0.37


def bucket(m: int) -> int:
    """The bucket of match length m ≥ 1 (``EDGES``)."""
    return max(0, bisect.bisect_right(EDGES, m) - 1)


class MatchTable:
    """Per-token acceptance α per match-length bucket: Beta(start·strength, (1 − start)·strength) prior
    counts, every observed token a trial, all counts discounted by ``decay`` per observed step (so the
    table follows the current request), rates non-decreasing in the match length."""

    def __init__(self, start: float = LOOKUP_START_ALPHA, strength: float = 2.0, decay: float = 0.98) -> None:
        if not 0.0 < start < 1.0 or strength <= 0 or not 0.0 < decay <= 1.0:
            raise ValueError(f"need start in (0, 1), strength > 0, decay in (0, 1]; got {start}, {strength}, {decay}")
        self.start, self.strength, self.decay = start, strength, decay
        self.trials = [0.0] * len(EDGES)
        self.successes = [0.0] * len(EDGES)
        self._refit()

    def _refit(self) -> None:
        """Posterior means per bucket, made non-decreasing weighted by observed trials only: a bucket never
        seen takes its neighbours' rate where its prior would break the order, and cannot drag them."""
        rates = [
            (self.start * self.strength + s) / (self.strength + t)
            for s, t in zip(self.successes, self.trials, strict=True)
        ]
        weights = [t + 1e-3 for t in self.trials]
        self.rates = isotonic(rates, weights)
        self.floors = isotonic(
            [
                shifted_rate(s / t, t, -PESSIMISM) if t else 0.0  # observations alone
                for s, t in zip(self.successes, self.trials, strict=True)
            ],
            weights,
        )

    def alpha(self, m: int) -> float:
        """Per-token acceptance at match length m."""
        return self.rates[bucket(max(1, m))]

    def path(self, m: int, upper: int, lower: bool = False) -> tuple[float, ...]:
        """(P_1..P_upper) of a proposal made at match length m: P_j = Π_{u≤j} α(m + u − 1); with ``lower``,
        each α its lower confidence bound (``PESSIMISM`` standard errors below the rate)."""
        rates = self.floors if lower else self.rates
        out, p = [], 1.0
        for u in range(upper):
            p *= rates[bucket(max(1, m + u))]
            out.append(p)
        return tuple(out)

    def observe(self, m: int, compared: int, accepted: int) -> None:
        """One proposal made at match length m: its first ``compared`` tokens were checked against what the
        step emitted and the first ``accepted`` ≤ compared matched (a failure at ``accepted`` + 1 when
        accepted < compared). Raises ValueError for accepted outside [0, compared]."""
        if not 0 <= accepted <= compared:
            raise ValueError(f"accepted must be in [0, {compared}], got {accepted}")
        if compared == 0:
            return
        self.trials = [t * self.decay for t in self.trials]
        self.successes = [s * self.decay for s in self.successes]
        for u in range(min(compared, accepted + 1)):
            b = bucket(m + u)
            self.trials[b] += 1.0
            self.successes[b] += 1.0 if u < accepted else 0.0
        self._refit()


class MatchMemory:
    """One ``MatchTable`` per drafter key (a (target, prompt lookup) pair), kept across requests."""

    def __init__(self, factory: Callable[[], MatchTable] = MatchTable) -> None:
        self.factory = factory
        self._tables: dict[str, MatchTable] = {}

    def table_for(self, key: str) -> MatchTable:
        """The pair's table, created on first use."""
        if key not in self._tables:
            self._tables[key] = self.factory()
        return self._tables[key]


class MatchAcceptance:
    """Prompt lookup's acceptance model for the controller: the pair's ``MatchTable`` priced at each row's
    match length (from the step's evidence), taught by hindsight on every row every step."""

    confidence_stopped = False

    def __init__(self, batch: int, table: MatchTable) -> None:
        self.table = table
        self.matches = [1] * batch  # the match length of each row's current offer

    def see(self, evidence: Sequence[int]) -> None:
        """The rows' match lengths for this step's offers."""
        self.matches = [max(1, int(m)) for m in evidence]

    def path(self, i: int, upper: int) -> tuple[float, ...]:
        return self.table.path(self.matches[i], upper)

    def floor(self, i: int, upper: int) -> tuple[float, ...]:
        """Lower confidence bounds of row i's (P_1..P_upper)."""
        return self.table.path(self.matches[i], upper, lower=True)

    def alpha(self, i: int) -> float:
        return self.table.alpha(self.matches[i])

    def observe(self, i: int, compared: int, accepted: int, confidences: tuple[float, ...]) -> None:
        """Row i's hindsight (or real) outcome of the proposal offered at its match length."""
        self.table.observe(self.matches[i], compared, accepted)

    def select(self, rows: torch.Tensor) -> None:
        self.matches = [self.matches[int(i)] for i in rows]
