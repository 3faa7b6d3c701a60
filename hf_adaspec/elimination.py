"""Confidence-prior drafting and verification for a padded batch: how many columns to draft and verify.

Notation: p = target, q = draft. After drafting, row i of a static batch holds k_i tokens whose
prefixes are accepted with predicted probabilities P_i1 ≥ P_i2 ≥ … (calibrated draft confidence, or
α_i^j for prompt lookup). The target verifies every row over w + 1 positions, w = max_i k_i, so the
verify forward costs t_verify_b(w + 1) whatever the rows' own k_i. AdaSpec's token elimination
(arXiv 2503.05096) drops the lowest-confidence tail tokens across the batch: cutting to width w' < w
drops each row's tokens past w' (prefix probabilities only fall with j) and keeps the width of highest
predicted step goodput

    goodput(w') = Σ_i (1 + Σ_{j ≤ min(k_i, w')} P_ij) / (t_spent + t_verify_b(w' + 1))

(SmartSpec, arXiv 2406.14066, §4.2, for a padded batch; ``t_spent`` is the drafting already done, paid
whatever is kept). Ties keep the narrower width. While drafting, the same goodput decides whether one
more draft column pays: the next token of each row is predicted (ĉ_{j+1} = c_j·c̄), and the column is
drafted only if goodput with it, its draft forward included, beats goodput without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


def batch_expected_tokens(prefix_probs: Sequence[Sequence[float]], width: int) -> float:
    """Σ_i (1 + Σ_{j ≤ min(k_i, width)} P_ij): expected tokens of a batch step verified over width + 1
    positions; prefix_probs[i] = (P_i1..P_ik_i). Tokens per step."""
    return sum(1.0 + sum(row[:width]) for row in prefix_probs)


def width_goodput(
    prefix_probs: Sequence[Sequence[float]], width: int, spent_ms: float, t_verify_ms: Callable[[int], float]
) -> float:
    """Predicted batch goodput (tokens/s) of verifying ``width`` drafted columns after ``spent_ms`` of drafting."""
    return 1000.0 * batch_expected_tokens(prefix_probs, width) / (spent_ms + t_verify_ms(width + 1))


def best_width(prefix_probs: Sequence[Sequence[float]], spent_ms: float, t_verify_ms: Callable[[int], float]) -> int:
    """Token elimination: the verified width w' ∈ {0..max_i k_i} of highest ``width_goodput``; ties keep
    the narrower. w' = 0 verifies no draft token (a plain step, the drafting wasted).

    Raises:
        ValueError: a probability outside [0, 1].
    """
    if any(not 0.0 <= p <= 1.0 for row in prefix_probs for p in row):
        raise ValueError(f"prefix acceptance probabilities must be in [0, 1], got {list(map(list, prefix_probs))}")
    widest = max((len(row) for row in prefix_probs), default=0)
    rates = [width_goodput(prefix_probs, w, spent_ms, t_verify_ms) for w in range(widest + 1)]
    return max(range(widest + 1), key=lambda w: (rates[w], -w))


def should_draft_column(
    prefix_probs: Sequence[Sequence[float]],
    next_probs: Sequence[float],
    spent_ms: float,
    draft_ms: float,
    t_verify_ms: Callable[[int], float],
) -> bool:
    """Whether to draft column j + 1 (j = max_i len(prefix_probs[i]) drafted so far): yes iff predicted
    goodput with it — every row i gaining ``next_probs[i]`` (0 for rows that draft no further), at
    ``draft_ms`` for the extra draft forward — beats goodput at width j. Ties stop."""
    j = max((len(row) for row in prefix_probs), default=0)
    now = width_goodput(prefix_probs, j, spent_ms, t_verify_ms)
    gained = batch_expected_tokens(prefix_probs, j) + sum(next_probs)
    return 1000.0 * gained / (spent_ms + draft_ms + t_verify_ms(j + 2)) > now
