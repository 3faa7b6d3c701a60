"""Goodput math: expected accepted length and the proposal length that maximises tokens per second.

Notation (used throughout hf-adaspec): p = target distribution, q = draft distribution, k = proposal
length, α = probability that one draft token is accepted (assumed i.i.d. per position).

Sources: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Eq. (1)
(expected tokens per step); SmartSpec/TurboSpec, arXiv 2406.14066, §4 (goodput = generated tokens per
unit time, proposal length chosen to maximise it).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KChoice:
    """A chosen proposal length k and its predicted goodput (tokens/s)."""

    k: int
    goodput: float


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per step | k, α] = (1 − α^(k+1)) / (1 − α)  (Leviathan et al. 2023, Eq. 1).

    Counts accepted draft tokens plus the one bonus/correction token, so k=0 gives 1.0 (a plain step).

    Raises:
        ValueError: α outside [0, 1] or k < 0.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"acceptance rate alpha must be in [0, 1], got {alpha}")
    if k < 0:
        raise ValueError(f"proposal length k must be >= 0, got {k}")
    if alpha == 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def step_time_ms(k: int, t_draft_ms: float, t_verify_ms: Callable[[int], float]) -> float:
    """Predicted wall time of one step, ms: k·t_draft + t_verify(k+1); k=0 is one plain forward."""
    return k * t_draft_ms + t_verify_ms(k + 1)


def goodput(alpha: float, k: int, t_draft_ms: float, t_verify_ms: Callable[[int], float]) -> float:
    """Goodput(k) = E[tokens | k, α] / (k·t_draft + t_verify(k+1)), in tokens per second.

    ``t_verify_ms(n)`` is the measured latency (ms) of a target forward over n new tokens; ``t_draft_ms``
    the cost of proposing one draft token (ms). SmartSpec (arXiv 2406.14066) Eq. for goodput.
    """
    return 1000.0 * expected_tokens(alpha, k) / step_time_ms(k, t_draft_ms, t_verify_ms)


def horizon_goodput(rate: float, setup_ms: float, horizon: int) -> float:
    """Tokens/s over the next ``horizon`` tokens when a one-off ``setup_ms`` (e.g. the draft ingesting
    the prompt) precedes steps running at ``rate`` tokens/s: H / (setup + H / rate)."""
    if setup_ms <= 0 or rate <= 0:
        return rate
    return horizon / (setup_ms / 1000.0 + horizon / rate)


def best_k(
    alpha: float,
    k_max: int,
    t_draft_ms: float,
    t_verify_ms: Callable[[int], float],
    setup_ms: float = 0.0,
    horizon: int = 1,
    min_gain: float = 0.0,
) -> KChoice:
    """The k ∈ {0..k_max} with the highest goodput; ties pick the smaller k.

    A k > 0 carries the one-off ``setup_ms`` amortised over ``horizon`` tokens (``horizon_goodput``)
    and must beat plain decoding (k = 0) by the relative margin ``min_gain`` to be chosen.
    """
    plain = goodput(alpha, 0, t_draft_ms, t_verify_ms)
    best = KChoice(k=0, goodput=plain)
    for k in range(1, k_max + 1):
        rate = horizon_goodput(goodput(alpha, k, t_draft_ms, t_verify_ms), setup_ms, horizon)
        if rate > best.goodput and rate > plain * (1.0 + min_gain):
            best = KChoice(k=k, goodput=rate)
    return best


def batch_goodput(
    alphas: Sequence[float], uppers: Sequence[int], k: int, t_draft_ms: float, t_verify_ms: Callable[[int], float]
) -> float:
    """Batch goodput (tokens/s) of a static padded batch where row i drafts min(k, u_i) tokens:
    Σ_i E[tokens | min(k, u_i), α_i] / (k·t_draft + t_verify(k+1)), costs measured at this batch size.

    Every row of a padded batch occupies k+1 verified positions whatever its own proposal length, so
    the step time depends on the batch-wide k (SmartSpec, arXiv 2406.14066, §4.2, with the batch's
    verified tokens B·(k+1) instead of Σ_i (k_i+1)).
    """
    tokens = sum(expected_tokens(a, min(k, u)) for a, u in zip(alphas, uppers, strict=True))
    return 1000.0 * tokens / step_time_ms(k, t_draft_ms, t_verify_ms)


@dataclass(frozen=True)
class BatchPlan:
    """A batch step: batch-wide k, each row's drafter (an index), predicted batch goodput (tokens/s)."""

    k: int
    drafters: tuple[int, ...]
    goodput: float


def _rows_tokens(alphas, uppers, enabled: Sequence[int], k: int) -> tuple[float, tuple[int, ...]]:
    """Σ_i max over enabled drafters d of E[tokens | min(k, u_di), α_di], and each row's best d."""
    total, picks = 0.0, []
    for i in range(len(alphas[0])):
        e, d = max((expected_tokens(alphas[d][i], min(k, uppers[d][i])), -d) for d in enabled)
        total, picks = total + e, picks + [-d]
    return total, tuple(picks)


def best_batch_plan(
    alphas: Sequence[Sequence[float]],
    uppers: Sequence[Sequence[int]],
    draft_ms: Sequence[float],
    t_verify_ms: Callable[[int], float],
    setup_ms: Sequence[float] | None = None,
    horizon: int = 1,
    min_gain: float = 0.0,
) -> BatchPlan:
    """The batch-wide k and per-row drafters with the highest batch goodput; k = 0 is a plain step.

    alphas[d][i], uppers[d][i]: drafter d's acceptance estimate for row i and the most tokens it offers.
    A drafter with a cost (``draft_ms[d]`` per drafted token, one-off ``setup_ms[d]`` amortised over
    ``horizon`` batch tokens) pays it once for the whole batch when any row uses it; free drafters
    (prompt lookup) are always available. Each row takes its best enabled drafter. Goodput =
    Σ_i E_i / (k·Σ_enabled t_draft + t_verify(k+1)) (SmartSpec, arXiv 2406.14066, §4.2, for a padded
    batch); a k > 0 must beat a plain step by ``min_gain``. Ties keep the smaller k and drafter index.
    """
    setup = list(setup_ms) if setup_ms is not None else [0.0] * len(draft_ms)
    rows = len(alphas[0])
    plain = 1000.0 * rows / t_verify_ms(1)
    best = BatchPlan(0, (0,) * rows, plain)
    paid = [d for d in range(len(draft_ms)) if draft_ms[d] > 0 or setup[d] > 0]
    free = [d for d in range(len(draft_ms)) if d not in paid]
    k_top = max((u for row in uppers for u in row), default=0)
    for n_paid in range(len(paid) + 1):
        for chosen in itertools.combinations(paid, n_paid):
            enabled = sorted(free + list(chosen))
            if not enabled:
                continue
            for k in range(1, k_top + 1):
                tokens, picks = _rows_tokens(alphas, uppers, enabled, k)
                rate = 1000.0 * tokens / (k * sum(draft_ms[d] for d in chosen) + t_verify_ms(k + 1))
                rate = horizon_goodput(rate, sum(setup[d] for d in chosen), horizon)
                if rate > best.goodput and rate > plain * (1.0 + min_gain):
                    best = BatchPlan(k, picks, rate)
    return best
