"""Oracle bound on goodput: each step drafts exactly the run of tokens that will be accepted.

Given, for every generated position, whether the drafter's greedy guess equals the target's token
(``agree[i]``; e.g. from one teacher-forced draft forward over the final output), the oracle at
position i drafts k = the length of the agreement run starting at i (capped at k_max and the tokens
left), so every drafted token is accepted and the step emits k + 1 tokens. Costed with the same table
as the controller (k·t_draft + t_verify(k+1)), this bounds what any k-choosing policy can reach.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OracleResult:
    """Oracle schedule: proposal length per step, total time (ms) and goodput (tokens/s)."""

    ks: tuple[int, ...]
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


def oracle_schedule(
    agree: Sequence[bool], k_max: int, t_draft_ms: float, t_verify_ms: Callable[[int], float]
) -> OracleResult:
    """Oracle over ``len(agree)`` generated tokens: at each step draft the whole accepted run.

    ``agree[i]``: whether the drafter's guess for generated token i equals the target's. A step at
    position i drafts k = min(run[i], k_max, tokens left − 1) and emits k + 1 tokens (the last one is the
    target's bonus/correction token). Always drafting pays here because nothing drafted is wasted —
    unless drafting costs more than it saves, so each step also compares with plain steps over the
    same k + 1 tokens and takes the cheaper.
    """
    runs, ks, time_ms, i, n = agreement_runs(agree), [], 0.0, 0, len(agree)
    while i < n:
        k = min(runs[i], k_max, n - i - 1)
        spec_ms = k * t_draft_ms + t_verify_ms(k + 1)
        plain_ms = (k + 1) * t_verify_ms(1)
        if k and spec_ms < plain_ms:
            ks.append(k)
            time_ms += spec_ms
        else:
            ks.extend([0] * (k + 1))
            time_ms += plain_ms
        i += k + 1
    return OracleResult(tuple(ks), time_ms, n)
