"""Confidence-prior drafting: stop drafting when the draft's own confidence says the next token no
longer pays (AdaSpec, arXiv 2503.05096).

Notation: p = target distribution, q = draft distribution. While drafting, a request keeps the draft's
confidence in its proposal so far, c_j = Π_{u≤j} q(x_u) (the running product of the draft's
probabilities of its own tokens). An online, per-pair calibration maps c_j to the observed probability
that the whole prefix of j drafted tokens is accepted, P_j = P(prefix j accepted | c_j). Then
(Leviathan et al. 2023, Eq. 1, generalised to non-i.i.d. acceptance)

    E(k) = 1 + Σ_{j=1..k} P_j        goodput(k) = E(k) / (k·t_draft + t_verify(k+1))

(SmartSpec, arXiv 2406.14066, §4, with the measured ``CostTable``). Predict → execute → correct:
before drafting token j+1 the next confidence is predicted as ĉ_{j+1} = c_j·c̄ (c̄: the request's mean
per-token confidence); token j+1 is drafted only if the predicted goodput rises; once drafted, its
real confidence replaces the prediction.

``ConfidenceController`` runs that rule; ``PMinController`` is the llama.cpp baseline (stop once a
drafted token's q(x_u) < p_min). Besides the ``Controller`` protocol both offer ``stop_rule(drafter)``:
a callable ``stop(j, confidences) -> bool`` that the engine hands the draft-model proposer, asked after
each drafted token (j drafted so far, ``confidences`` their q(x_u)); ``choose`` only sets the cap k_upper.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .acceptance import AcceptanceEstimator, nearest_rank
from .controller import Candidate, Decision, DraftOption, select_decision
from .cost_tracking import TrackedCosts
from .costs import CostTable, DrafterCosts
from .goodput import horizon_goodput, step_time_ms
from .recalibration import RequestRecalibration
from .target_confidence import TargetConfidenceMap, interpolate_bins, judged_positions

StopRule = Callable[[int, tuple[float, ...]], bool]


def isotonic(values: Sequence[float], weights: Sequence[float]) -> tuple[float, ...]:
    """Weighted least-squares non-decreasing fit by pool-adjacent-violators (Ayer et al. 1955).

    Adjacent values that violate the order are pooled into their weighted mean until none does.

    Raises:
        ValueError: lengths differ or a weight is not > 0.
    """
    if len(values) != len(weights):
        raise ValueError(f"values and weights differ in length: {len(values)} != {len(weights)}")
    if any(not w > 0 for w in weights):
        raise ValueError(f"weights must be > 0, got {list(weights)}")
    blocks: list[tuple[float, float, int]] = []  # (mean, weight, values pooled)
    for v, w in zip(values, weights):
        blocks.append((float(v), float(w), 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2, n2), (m1, w1, n1) = blocks.pop(), blocks.pop()
            blocks.append(((m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2))
    return tuple(mean for mean, _, count in blocks for _ in range(count))


def prefix_confidences(confidences: Sequence[float]) -> tuple[float, ...]:
    """c_j = Π_{u≤j} q(x_u) for j = 1..k, from the per-token confidences q(x_1..x_k)."""
    return tuple(math.prod(confidences[: j + 1]) for j in range(len(confidences)))


class ConfidenceCalibrator:
    """Online, binned map from cumulative confidence c ∈ [0, 1] to P(prefix of j drafts accepted).

    ``n_bins`` equal bins over [0, 1] count trials and successes, each starting with ``prior_strength``
    pseudo-trials at the identity calibration (P = c at the bin centre); the per-bin rates are made
    non-decreasing by ``isotonic``. Predictions are optimistic under uncertainty: each bin's rate plus
    ``optimism`` standard errors, √(P(1−P)/(n+1)) for n trials (an upper confidence bound), made
    non-decreasing again by ``isotonic`` weighted by trials, and interpolated linearly between bin
    centres. Without it a pessimistic start predicts that drafting never pays, and since only drafted
    tokens are observed the calibration would never learn otherwise (measured: mean k 0.00 on 12 of 13
    Spec-Bench categories); the bonus shrinks as 1/√n, so a well-observed bin predicts its observed
    rate. It also keeps the pair's running mean per-token confidence (``token_mean``), each past
    request's mean (``request_means``) and the map from the target's confidence to the draft's
    (``target_map``, see ``target_confidence``). With ``seed_quantile`` (default None: off) a
    request's c̄ starts at that quantile of the past requests' means (``request_seed``; ``token_mean``
    before 3 requests): optimism again, now per request. Acceptance differs more between requests
    than within one (greedy draft agreement 0.52 on roleplay to 0.93 on math), and a request whose c̄
    starts at the pair's mean never drafts when only well-predicted requests pay, so it never learns
    that it is one of them. Seeded high, it drafts, and its own confidences pull c̄ down within a few
    tokens when it is not. Off by default: with online cost correction it drafted more (mean k 0.28 vs
    0.15) but stayed below the uncorrected default overall (README).
    One calibrator per (target, drafter) pair, kept across requests (``CalibratorMemory``).
    """

    def __init__(self, n_bins: int = 10, prior_strength: float = 2.0, token_mean: float = 0.7,
                 optimism: float = 1.0, seed_quantile: float | None = None) -> None:
        if n_bins < 1 or prior_strength <= 0 or not 0.0 <= token_mean <= 1.0 or optimism < 0:
            raise ValueError(f"need n_bins >= 1, prior_strength > 0, token_mean in [0, 1], optimism >= 0; "
                             f"got {n_bins}, {prior_strength}, {token_mean}, {optimism}")
        if seed_quantile is not None and not 0.0 <= seed_quantile <= 1.0:
            raise ValueError(f"seed_quantile must be in [0, 1], got {seed_quantile}")
        self.centres = tuple((b + 0.5) / n_bins for b in range(n_bins))
        self.trials = [prior_strength] * n_bins
        self.successes = [prior_strength * c for c in self.centres]
        self.token_mean, self.tokens_seen, self.optimism = token_mean, 0, optimism
        self.seed_quantile, self.request_means = seed_quantile, []
        self.target_map = TargetConfidenceMap(n_bins)  # q(x_u) given the target's p_max, for plain steps
        self._refit()

    def request_seed(self) -> float:
        """A new request's starting c̄: the ``seed_quantile`` (nearest rank) of the past requests' mean
        per-token confidences; ``token_mean`` before 3 requests have drafted, or without a quantile."""
        if self.seed_quantile is None or len(self.request_means) < 3:
            return self.token_mean
        return nearest_rank(self.request_means, self.seed_quantile)

    def note_request(self, slot: int | None, mean: float) -> int:
        """Set request ``slot``'s mean per-token confidence (``slot`` None: a new request); its slot."""
        if slot is None:
            self.request_means.append(mean)
            return len(self.request_means) - 1
        self.request_means[slot] = mean
        return slot

    def _refit(self) -> None:
        """Isotonic rates per bin, then their upper bounds made non-decreasing (weighted by trials), ≤ 1."""
        rates = isotonic([s / t for s, t in zip(self.successes, self.trials)], self.trials)
        upper = [min(1.0, r + self.optimism * math.sqrt(r * (1.0 - r) / (n + 1.0))) for r, n in zip(rates, self.trials)]
        self._fitted = isotonic(upper, self.trials)  # weighted: a rarely seen bin cannot lift a well-seen one

    def _bin(self, c: float) -> int:
        return min(int(c * len(self.centres)), len(self.centres) - 1)

    def predict(self, c: float) -> float:
        """P(prefix accepted | cumulative confidence c): its upper confidence bound, non-decreasing in c.

        Raises:
            ValueError: c outside [0, 1].
        """
        if not 0.0 <= c <= 1.0:
            raise ValueError(f"confidence must be in [0, 1], got {c}")
        return interpolate_bins(self.centres, self._fitted, c)

    def update(self, confidences: Sequence[float], accepted: int) -> None:
        """Record one verified proposal: q(x_1..x_k) of its k drafted tokens, ``accepted`` n ≤ k.

        The prefix of j tokens was accepted iff j ≤ n: positions j ≤ n are successes, every j > n a
        failure (its prefix contains the rejected token n+1), so every drafted prefix is observed.

        Raises:
            ValueError: accepted outside [0, k].
        """
        if not 0 <= accepted <= len(confidences):
            raise ValueError(f"accepted must be in [0, {len(confidences)}], got {accepted}")
        for j, c in enumerate(prefix_confidences(confidences), start=1):
            b = self._bin(c)
            self.trials[b] += 1.0
            self.successes[b] += 1.0 if j <= accepted else 0.0
        for q in confidences:
            self.tokens_seen += 1
            self.token_mean += (q - self.token_mean) / (self.tokens_seen + 1)  # the seed counts as one token
        self._refit()


class CalibratorMemory:
    """One ``ConfidenceCalibrator`` per drafter key (a (target, drafter) pair), kept across requests."""

    def __init__(self, factory: Callable[[], ConfidenceCalibrator] = ConfidenceCalibrator) -> None:
        self.factory = factory
        self._calibrators: dict[str, ConfidenceCalibrator] = {}

    def calibrator_for(self, key: str) -> ConfidenceCalibrator:
        """The pair's calibrator, created on first use."""
        if key not in self._calibrators:
            self._calibrators[key] = self.factory()
        return self._calibrators[key]


class RunningMean:
    """Mean of the observed values, seeded with ``seed`` worth ``weight`` observations."""

    def __init__(self, seed: float, weight: float = 4.0) -> None:
        self.value, self.weight = seed, weight

    def add(self, x: float) -> None:
        """Fold in one observation."""
        self.weight += 1.0
        self.value += (x - self.value) / self.weight


def expected_tokens_prefix(prefix_probs: Sequence[float]) -> float:
    """E(k) = 1 + Σ_{j=1..k} P(prefix j accepted), k = len(prefix_probs); tokens per step.

    Leviathan et al. 2023, Eq. 1, without the i.i.d. assumption (there P_j = α^j). k = 0 gives 1.0.

    Raises:
        ValueError: a probability outside [0, 1].
    """
    if any(not 0.0 <= p <= 1.0 for p in prefix_probs):
        raise ValueError(f"prefix acceptance probabilities must be in [0, 1], got {list(prefix_probs)}")
    return 1.0 + sum(prefix_probs)


def prefix_goodput(prefix_probs: Sequence[float], t_draft_ms: float, t_verify_ms: Callable[[int], float]) -> float:
    """goodput(k) = E(k) / (k·t_draft + t_verify(k+1)) in tokens/s (SmartSpec, arXiv 2406.14066, §4)."""
    k = len(prefix_probs)
    return 1000.0 * expected_tokens_prefix(prefix_probs) / step_time_ms(k, t_draft_ms, t_verify_ms)


def prefix_tpot_ms(prefix_probs: Sequence[float], t_draft_ms: float, t_verify_ms: Callable[[int], float]) -> float:
    """Predicted time per output token (ms/token) of a step drafting len(prefix_probs) tokens."""
    return step_time_ms(len(prefix_probs), t_draft_ms, t_verify_ms) / expected_tokens_prefix(prefix_probs)


def prefix_candidate(
    prefix_probs: Sequence[float], t_draft_ms: float, t_verify_ms: Callable[[int], float],
    setup_ms: float = 0.0, horizon: int = 1,
) -> Candidate:
    """A step drafting len(prefix_probs) tokens as a ``Candidate``: goodput with the one-off
    ``setup_ms`` amortised over ``horizon`` tokens when it drafts (``horizon_goodput``), and TPOT."""
    k = len(prefix_probs)
    rate = prefix_goodput(prefix_probs, t_draft_ms, t_verify_ms)
    rate = horizon_goodput(rate, setup_ms, horizon) if k else rate
    alpha = prefix_probs[0] if k else math.nan
    return Candidate(Decision(k, 0, alpha, rate), prefix_tpot_ms(prefix_probs, t_draft_ms, t_verify_ms))


def should_draft_next(
    prefix_probs: Sequence[float],
    next_prob: float,
    t_draft_ms: float,
    t_verify_ms: Callable[[int], float],
    setup_ms: float = 0.0,
    horizon: int = 1,
    min_gain: float = 0.0,
    tpot_slo_ms: float | None = None,
) -> bool:
    """Whether to draft token j+1, j = len(prefix_probs) drafted so far with calibrated P_1..P_j,
    given the predicted P_{j+1} = ``next_prob`` (AdaSpec's predict step, arXiv 2503.05096).

    Yes iff goodput(j+1) > goodput(j) (ties stop, as ``best_k`` keeps the smaller k); from j = 0 the
    first token must beat a plain step by ``min_gain``. With ``tpot_slo_ms``, a length whose predicted
    TPOT breaks the SLO loses to one that meets it, and if neither meets it the lower TPOT wins
    (``select_decision``).
    """
    now = prefix_candidate(prefix_probs, t_draft_ms, t_verify_ms, setup_ms, horizon)
    nxt = prefix_candidate([*prefix_probs, next_prob], t_draft_ms, t_verify_ms, setup_ms, horizon)
    margin = min_gain if not prefix_probs else 0.0
    return select_decision(now, [nxt], margin, tpot_slo_ms).k > now.decision.k


def pmin_stop(p_min: float) -> StopRule:
    """llama.cpp-style stop rule: stop once the last drafted token's q(x_u) < ``p_min``.

    Unlike llama.cpp, which drops that token, it stays in the proposal (as transformers'
    ``assistant_confidence_threshold`` does): its draft forward is already paid.
    """
    return lambda j, confidences: bool(confidences) and confidences[-1] < p_min


class ConfidenceController(TrackedCosts):
    """Draft-model speculation whose length is set token by token by ``should_draft_next`` on the
    calibrated confidence (AdaSpec, arXiv 2503.05096); k = 0 (a plain step) when even one draft token
    is predicted not to pay. Uses the first option's drafter (a draft model). ``adapt_costs``: correct
    the costs by realized step times (``cost_tracking``). ``target_confidence``: on a plain step, fold
    the draft confidence that the target's p_max predicts into c̄ (``observe_target``). ``recalibrate``:
    scale the pooled calibration by this request's observed / expected accepted tokens (``recalibration``)."""

    def __init__(
        self,
        costs: CostTable,
        drafter: DrafterCosts,
        calibrator: ConfidenceCalibrator | None = None,
        min_gain: float = 0.03,
        tpot_slo_ms: float | None = None,
        mean_weight: float = 4.0,
        adapt_costs: bool = False,
        target_confidence: bool = False,
        recalibrate: bool = False,
    ) -> None:
        self._track_costs(costs, [drafter], adapt_costs)
        self.uses_target = target_confidence  # the engine reports the target's p_max (observe_target)
        self.min_gain, self.tpot_slo_ms = min_gain, tpot_slo_ms
        self.calibrator = calibrator or ConfidenceCalibrator()
        self.c_bar = RunningMean(self.calibrator.request_seed(), mean_weight)  # this request's c̄, seeded per pair
        self._q_sum, self._q_count, self._slot = 0.0, 0, None  # this request's Σ q(x_u), its count and slot
        self.estimator = AcceptanceEstimator()
        self.recalibration = RequestRecalibration(active=recalibrate)
        self._setup_ms, self._horizon = 0.0, 1

    def _predict(self, c: float) -> float:
        """P(prefix accepted | cumulative confidence c) for this request: the pooled calibration times ρ."""
        return self.recalibration.scale(self.calibrator.predict(c))

    def _draft_more(self, prefix_probs: Sequence[float], c_j: float) -> bool:
        """Predict ĉ_{j+1} = c_j·c̄ and ask ``should_draft_next`` whether token j+1 pays."""
        next_prob = self._predict(min(1.0, c_j * self.c_bar.value))
        return should_draft_next(prefix_probs, next_prob, self.drafters[0].draft_ms, self.costs.t_verify,
                                 self._setup_ms, self._horizon, self.min_gain, self.tpot_slo_ms)

    def choose(self, options: Sequence[DraftOption], horizon: int = 1) -> Decision:
        """k = k_upper of the first option if some length along the predicted path ĉ_j = c̄^j beats a
        plain step (by ``min_gain``, setup amortised, within the SLO), else 0; the stop rule then ends
        the proposal on the real confidences. Judging the whole path, not only token 1, matters when a
        one-off catch-up must be amortised: one token rarely pays it, a run of them may. Reports the
        best length's predicted goodput; alpha = P(accept | c̄)."""
        opt = options[0]
        best = select_decision(*self._path_candidates(opt, horizon), self.min_gain, self.tpot_slo_ms)
        return self._draft_decision(opt, best)

    def _path_candidates(self, opt: DraftOption, horizon: int) -> tuple[Candidate, list[Candidate]]:
        """A plain step and the draft's lengths k = 1..k_upper along the predicted path ĉ_j = c̄^j."""
        self._setup_ms, self._horizon = opt.catchup_tokens * self.drafters[0].catchup_ms, horizon
        path = [self._predict(self.c_bar.value ** j) for j in range(1, opt.k_upper + 1)]
        plain = prefix_candidate([], self.drafters[0].draft_ms, self.costs.t_verify)
        longer = [prefix_candidate(path[:k], self.drafters[0].draft_ms, self.costs.t_verify, self._setup_ms, horizon)
                  for k in range(1, opt.k_upper + 1)]
        return plain, longer

    def _draft_decision(self, opt: DraftOption, best: Decision) -> Decision:
        """``best`` as a draft-model step: k = k_upper (the stop rule ends it) or 0; alpha = P(accept | c̄)."""
        alpha = self._predict(self.c_bar.value)
        return Decision(opt.k_upper if best.k else 0, opt.drafter, alpha, best.predicted_goodput)

    def stop_rule(self, drafter: int) -> StopRule:
        """stop(j, confidences): True when token j+1 is predicted not to pay, from the real c_1..c_j."""
        def stop(j: int, confidences: tuple[float, ...]) -> bool:
            cs = prefix_confidences(confidences)
            return not self._draft_more([self._predict(c) for c in cs], cs[-1])

        return stop

    def observe(self, drafter: int, drafted: int, accepted: int, confidences: tuple[float, ...] = ()) -> None:
        """Correct: fold the real confidences and the verified outcome into the request's ρ (a plain step
        relaxes it), the pooled calibration and c̄."""
        self.estimator.update(drafted, accepted)
        if not drafted:
            self.recalibration.relax()
        if confidences and self.recalibration.active:  # off by default: no per-step predictions to pay for
            self.recalibration.update([self.calibrator.predict(c) for c in prefix_confidences(confidences)], accepted)
        if confidences:
            self.calibrator.update(confidences, accepted)
            for q in confidences:
                self.c_bar.add(q)
            self._q_sum, self._q_count = self._q_sum + sum(confidences), self._q_count + len(confidences)
            self._slot = self.calibrator.note_request(self._slot, self._q_sum / self._q_count)

    def observe_target(self, drafter: int, drafted: int, accepted: int, confidences: tuple[float, ...],
                       target_top: tuple[float, ...]) -> None:
        """Learn q(x_u) given p_max at the positions that judged a draft on an accepted prefix; on a plain
        step add the map's q for each p_max to c̄. ``target_top``: the target's top probability at the
        kept verified positions 0..n (n+1 values)."""
        m = judged_positions(drafted, accepted) if confidences else 0
        self.calibrator.target_map.update(target_top[:m], confidences[:m])
        if not drafted:
            for p in target_top:
                self.c_bar.add(self.calibrator.target_map.predict(p))


class PMinController:
    """llama.cpp-style baseline: draft up to k_upper, stopping once a drafted token's q(x_u) < p_min;
    no goodput model (predicted goodput NaN)."""

    def __init__(self, p_min: float = 0.75) -> None:
        if not 0.0 <= p_min <= 1.0:
            raise ValueError(f"draft_p_min must be in [0, 1], got {p_min}")
        self.p_min, self.estimator = p_min, AcceptanceEstimator()

    def choose(self, options: Sequence[DraftOption], horizon: int = 1) -> Decision:
        """Always the first option's k_upper (k_max capped by the budget)."""
        opt = options[0]
        return Decision(opt.k_upper, opt.drafter, self.estimator.alpha, math.nan)

    def stop_rule(self, drafter: int) -> StopRule:
        """``pmin_stop(p_min)``."""
        return pmin_stop(self.p_min)

    def observe(self, drafter: int, drafted: int, accepted: int, confidences: tuple[float, ...] = ()) -> None:
        """Track α for the step records."""
        self.estimator.update(drafted, accepted)
