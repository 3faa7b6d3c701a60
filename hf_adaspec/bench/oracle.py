"""Oracle bound on goodput: each step drafts exactly the run of tokens that will be accepted.

Given, for every generated position i, how many tokens drafter d would get accepted if it drafted
there (``runs[d][i]``: for a draft model the length of its greedy agreement run with the target's
output, from one teacher-forced forward; for prompt lookup the matching prefix of its n-gram
continuation), the oracle picks each step's drafter and k ≤ runs[d][i] knowing the future, so nothing
drafted is ever rejected and a step emits k + 1 tokens. Costed with the controller's measured table
(k·t_draft,d + t_verify(k+1), plus a paid drafter's one-off setup such as the draft ingesting the
prompt), the minimum total time over all schedules (dynamic programming over positions) bounds what
any k-choosing policy with these drafters can reach. Overheads the table does not hold (Python,
sampling, the catch-up after plain steps) are left out, which only makes the bound looser.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OracleDrafter:
    """One drafter for the oracle: runs[i] (tokens accepted if it drafts at generated position i),
    cost per drafted token (ms) and one-off setup (ms) paid if the schedule uses it at all."""

    runs: tuple[int, ...]
    draft_ms: float = 0.0
    setup_ms: float = 0.0

    def __post_init__(self) -> None:
        if any(r < 0 for r in self.runs) or self.draft_ms < 0 or self.setup_ms < 0:
            raise ValueError("oracle runs and costs must be >= 0")


@dataclass(frozen=True)
class OracleResult:
    """Oracle schedule: per step the proposal length and drafter index (-1: plain step), the total
    time (ms, setup included) and the tokens it generates."""

    ks: tuple[int, ...]
    drafters: tuple[int, ...]
    time_ms: float
    tokens: int

    @property
    def goodput(self) -> float:
        """Tokens per second of the oracle schedule."""
        return 1000.0 * self.tokens / self.time_ms if self.time_ms > 0 else 0.0


def agreement_runs(agree: Sequence[bool]) -> list[int]:
    """run[i] = number of consecutive True values starting at i (0 where agree[i] is False)."""
    runs = [0] * (len(agree) + 1)
    for i in range(len(agree) - 1, -1, -1):
        runs[i] = runs[i + 1] + 1 if agree[i] else 0
    return runs[:-1]


def _fastest(
    drafters: Sequence[OracleDrafter], enabled: Sequence[int], n: int, k_max: int, t_verify_ms: Callable[[int], float]
) -> OracleResult:
    """Minimum-time schedule over n tokens using only drafters ``enabled`` (setup excluded)."""
    best = [0.0] * (n + 1)  # best[i]: fastest time (ms) for tokens i..n-1
    move: list[tuple[int, int]] = [(0, -1)] * n  # (k, drafter) chosen at i
    for i in range(n - 1, -1, -1):
        best[i], move[i] = t_verify_ms(1) + best[i + 1], (0, -1)
        for d in enabled:
            for k in range(1, min(drafters[d].runs[i], k_max, n - i - 1) + 1):
                t = k * drafters[d].draft_ms + t_verify_ms(k + 1) + best[i + k + 1]
                if t < best[i]:
                    best[i], move[i] = t, (k, d)
    ks, used, i = [], [], 0
    while i < n:
        k, d = move[i]
        ks.append(k)
        used.append(d)
        i += k + 1
    return OracleResult(tuple(ks), tuple(used), best[0], n)


def oracle_schedule(drafters: Sequence[OracleDrafter], k_max: int, t_verify_ms: Callable[[int], float]) -> OracleResult:
    """The fastest schedule over the ``len(runs)`` generated tokens, knowing every acceptance.

    A step at position i drafts k ≤ min(runs[d][i], k_max, tokens left − 1) tokens with drafter d and
    emits k + 1 (the last is the target's bonus token), costing k·t_draft,d + t_verify(k+1) ms; a plain
    step costs t_verify(1). Every subset of drafters is tried so a setup is paid only when it pays.

    Raises:
        ValueError: drafters whose runs have different lengths.
    """
    if len({len(d.runs) for d in drafters}) > 1:
        raise ValueError("every oracle drafter needs runs over the same generated tokens")
    n = len(drafters[0].runs) if drafters else 0
    best: OracleResult | None = None
    for size in range(len(drafters) + 1):
        for enabled in itertools.combinations(range(len(drafters)), size):
            result = _fastest(drafters, enabled, n, k_max, t_verify_ms)
            setup = sum(drafters[d].setup_ms for d in set(result.drafters) if d >= 0)
            result = OracleResult(result.ks, result.drafters, result.time_ms + setup, n)
            if best is None or result.time_ms < best.time_ms:
                best = result
    return best if best is not None else OracleResult((), (), 0.0, 0)
