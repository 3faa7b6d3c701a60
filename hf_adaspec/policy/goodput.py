"""Goodput math: expected tokens per step, the step plan that maximises tokens per second, and the
rule that decides whether one more drafted column pays.

Notation (used throughout hf-adaspec): p = target distribution, q = draft distribution, k = proposal
length, α = probability that one draft token is accepted, P_j = probability that the first j drafted
tokens are all accepted (α^j under i.i.d. acceptance; a calibrated confidence otherwise).

Sources: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", Eq. (1)
(expected tokens per step, E(k) = 1 + Σ_{j≤k} P_j); SmartSpec/TurboSpec, arXiv 2406.14066, §4 (goodput =
generated tokens per unit time, proposal length chosen to maximise it; §4.2 for a padded batch, where
every row occupies k + 1 verified positions); AdaSpec, arXiv 2503.05096 (TPOT SLO-aware selection).

``best_plan`` is the one argmax of the library: every controller that predicts goodput decides with it,
at any batch size, and ``draft_next_column`` is the one stop rule for confidence-stopped drafting.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TVerify = Callable[[int], float]  # t_verify(n): ms of a target forward over n new tokens


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


def expected_tokens_prefix(prefix_probs: Sequence[float]) -> float:
    """E(k) = 1 + Σ_{j=1..k} P_j, k = len(prefix_probs): tokens per step (Leviathan et al. 2023, Eq. 1,
    without the i.i.d. assumption; P_j = α^j gives ``expected_tokens``).

    Raises:
        ValueError: a probability outside [0, 1].
    """
    if any(not 0.0 <= p <= 1.0 for p in prefix_probs):
        raise ValueError(f"prefix acceptance probabilities must be in [0, 1], got {list(prefix_probs)}")
    return 1.0 + sum(prefix_probs)


def step_time_ms(k: int, t_draft_ms: float, t_verify_ms: TVerify) -> float:
    """Predicted wall time of one step, ms: k·t_draft + t_verify(k+1); k=0 is one plain forward."""
    return k * t_draft_ms + t_verify_ms(k + 1)


def goodput(alpha: float, k: int, t_draft_ms: float, t_verify_ms: TVerify) -> float:
    """Goodput(k) = E[tokens | k, α] / (k·t_draft + t_verify(k+1)), tokens/s (SmartSpec, arXiv 2406.14066)."""
    return 1000.0 * expected_tokens(alpha, k) / step_time_ms(k, t_draft_ms, t_verify_ms)


def horizon_goodput(rate: float, setup_ms: float, horizon: int) -> float:
    """Tokens/s over the next ``horizon`` tokens when a one-off ``setup_ms`` (e.g. the draft ingesting
    the prompt) precedes steps running at ``rate`` tokens/s: H / (setup + H / rate)."""
    if setup_ms <= 0 or rate <= 0:
        return rate
    return horizon / (setup_ms / 1000.0 + horizon / rate)


@dataclass(frozen=True)
class DrafterPaths:
    """One drafter's priced paths this step, what ``best_plan`` chooses among: ``paths[i]`` = (P_i1..P_iu)
    for row i, u = the most tokens it can draft there; ``draft_ms`` per drafted column (0 for a free drafter
    such as prompt lookup); ``setup_ms`` one-off catch-up before it can draft; ``floors[i]``: lower confidence
    bounds of ``paths[i]`` (the slowdown ledger's pessimistic outcome; empty: none accepted)."""

    paths: tuple[tuple[float, ...], ...]
    draft_ms: float = 0.0
    setup_ms: float = 0.0
    floors: tuple[tuple[float, ...], ...] = ()

    @property
    def paid(self) -> bool:
        return self.draft_ms > 0 or self.setup_ms > 0


@dataclass(frozen=True)
class Plan:
    """A batch step: batch-wide k (0: a plain step), each row's drafter (an index into the drafters' paths),
    predicted goodput (tokens/s, setup amortised) and steady-state TPOT (ms per token per row)."""

    k: int
    drafters: tuple[int, ...]
    goodput: float
    tpot_ms: float


def select(plain: Plan, others: Sequence[Plan], min_gain: float = 0.0, tpot_slo_ms: float | None = None) -> Plan:
    """The plan of highest goodput among those meeting the TPOT SLO; ties keep the earlier.

    ``plain`` is the fallback; another plan must beat its goodput by the relative margin ``min_gain`` —
    unless ``plain`` itself breaks the SLO. With no plan meeting ``tpot_slo_ms`` (ms/token), the one with
    the lowest TPOT (best effort; AdaSpec, arXiv 2503.05096).
    """

    def meets(c: Plan) -> bool:
        return tpot_slo_ms is None or c.tpot_ms <= tpot_slo_ms

    best = plain if meets(plain) else None
    floor = plain.goodput * (1.0 + min_gain) if best is not None else 0.0
    for c in others:
        if meets(c) and c.goodput > floor and (best is None or c.goodput > best.goodput):
            best = c
    if best is None:
        return min((plain, *others), key=lambda c: c.tpot_ms)
    return best


def _expected(path: Sequence[float]) -> tuple[float, ...]:
    """(E(0), …, E(u)) of one row's path (P_1..P_u): E(j) = 1 + Σ_{i ≤ j} P_i (Leviathan et al. 2023, Eq. 1)."""
    return tuple(1.0 + sum(path[:j]) for j in range(len(path) + 1))


def _row_picks(
    expected: Sequence[Sequence[tuple[float, ...]]], enabled: Sequence[int], k: int
) -> tuple[float, tuple[int, ...]]:
    """Σ_i max over enabled drafters d of E_i = 1 + Σ_{j ≤ min(k, u_di)} P_dij, and each row's best d
    (``expected[d][i]``: row i's ``_expected`` under drafter d)."""
    total, picks = 0.0, []
    for i in range(len(expected[0])):
        e, d = max((expected[d][i][min(k, len(expected[d][i]) - 1)], -d) for d in enabled)
        total, picks = total + e, picks + [-d]
    return total, tuple(picks)


def floor_tokens(drafters: Sequence[DrafterPaths], picks: Sequence[int], k: int) -> float:
    """The pessimistic tokens of a step at width k: min over rows i of 1 + Σ_{j ≤ k} floor_ij of the row's
    drafter ``picks[i]`` (its ``DrafterPaths.floors``; none given: 0 accepted)."""
    return min(1.0 + sum(drafters[d].floors[i][:k]) if drafters[d].floors else 1.0 for i, d in enumerate(picks))


Admits = Callable[[float, float], bool]  # (step ms, pessimistic tokens) → whether the slowdown ledger allows it


def best_plan(
    drafters: Sequence[DrafterPaths],
    t_verify_ms: TVerify,
    horizon: int = 1,
    min_gain: float = 0.0,
    tpot_slo_ms: float | None = None,
    admits: Admits | None = None,
) -> Plan:
    """The batch-wide k and per-row drafters of highest predicted goodput over ``drafters[d]``, each drafter's
    priced paths; k = 0 is a plain step.

    goodput = Σ_i E_i / (k·Σ_{paid d used} t_draft,d + t_verify(k+1)) (SmartSpec §4.2, a padded batch);
    a paid drafter's ``setup_ms`` is amortised over ``horizon`` tokens per row (``horizon_goodput``); free
    drafters are always enabled; each row takes its best enabled drafter. A plan must beat a plain step
    by ``min_gain`` and meet ``tpot_slo_ms`` (``select``). Ties keep the smaller k and drafter index.
    Without an SLO, a plan that could not beat a plain step even with every row's whole path accepted is
    not assembled (the same choice, for less work on the steps that end plain). With ``admits`` (the
    slowdown ledger, ``policy.ledger``), a plan is a candidate only where its time with the whole setup
    (k·t_draft + setup + t_verify(k+1)) and its ``floor_tokens`` are admitted.
    """
    rows = len(drafters[0].paths)
    tv1 = t_verify_ms(1)
    plain = Plan(0, (0,) * rows, 1000.0 * rows / tv1, tv1)
    k_top = max((len(p) for dr in drafters for p in dr.paths), default=0)
    if not k_top:
        return plain  # no drafter has a path: no plan but the plain step (which ``select`` would return)
    paid = [d for d, dr in enumerate(drafters) if dr.paid]
    free = [d for d, dr in enumerate(drafters) if not dr.paid]
    expected = [[_expected(path) for path in dr.paths] for dr in drafters]  # [D][b] → (E(0)..E(u))
    bar = None if tpot_slo_ms is not None else plain.goodput * (1.0 + min_gain) * (1.0 - 1e-9)  # what select needs
    others = []
    for n_paid in range(len(paid) + 1):
        for chosen in itertools.combinations(paid, n_paid):
            enabled = sorted(free + list(chosen))
            if not enabled:
                continue
            draft_ms, setup_ms = sum(drafters[d].draft_ms for d in chosen), sum(drafters[d].setup_ms for d in chosen)
            most = sum(max(expected[d][i][-1] for d in enabled) for i in range(rows))  # tokens at any k, at most
            for k in range(1, k_top + 1):
                time_ms = k * draft_ms + t_verify_ms(k + 1)
                if bar is not None and horizon_goodput(1000.0 * most / time_ms, setup_ms, horizon * rows) < bar:
                    continue  # even every row's whole path accepted would not beat a plain step by min_gain
                tokens, picks = _row_picks(expected, enabled, k)
                if admits is not None and not admits(time_ms + setup_ms, floor_tokens(drafters, picks, k)):
                    continue
                rate = horizon_goodput(1000.0 * tokens / time_ms, setup_ms, horizon * rows)
                others.append(Plan(k, picks, rate, time_ms * rows / tokens))
    return select(plain, others, min_gain, tpot_slo_ms)


def draft_next_column(
    prefix_probs: Sequence[Sequence[float]], next_probs: Sequence[float], draft_ms: float, t_verify_ms: TVerify
) -> bool:
    """Whether to draft column j + 1 (j = the widest row's drafted tokens): yes iff the predicted goodput
    with it — each row i gaining ``next_probs[i]`` (0 for rows that draft no further), at ``draft_ms``
    for one more draft forward and one more verified position — beats goodput at width j (ties stop).
    AdaSpec's predict step (arXiv 2503.05096) with SmartSpec's batch goodput; ``prefix_probs[i]`` =
    (P_i1..P_ij_i). No TPOT SLO here: for the same rows TPOT is 1 / goodput, so it would agree.
    """
    j = max((len(r) for r in prefix_probs), default=0)
    tokens = sum(1.0 + sum(r[:j]) for r in prefix_probs)
    t_now = j * draft_ms + t_verify_ms(j + 1)
    t_next = (j + 1) * draft_ms + t_verify_ms(j + 2)
    return (tokens + sum(next_probs)) / t_next > tokens / t_now


def best_goodput(alpha: float, t_draft_ms: float, t_verify_ms: TVerify, k_max: int = 8) -> float:
    """max over k = 0..k_max of ``goodput``, tokens/s: a drafter's best speed at acceptance α."""
    return max(goodput(alpha, k, t_draft_ms, t_verify_ms) for k in range(k_max + 1))


def break_even_alpha(t_draft_ms: float, t_verify_ms: TVerify, rival_goodput: float, k_max: int = 8) -> float:
    """The least acceptance α at which a drafter costing ``t_draft_ms`` a token reaches ``rival_goodput``
    (tokens/s; e.g. ``best_goodput`` of the draft model at its own α), by bisection on the increasing
    ``best_goodput``; 1.0 when even α = 1 does not reach it (SmartSpec's goodput, arXiv 2406.14066)."""
    if best_goodput(1.0, t_draft_ms, t_verify_ms, k_max) < rival_goodput:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if best_goodput(mid, t_draft_ms, t_verify_ms, k_max) < rival_goodput else (low, mid)
    return high
