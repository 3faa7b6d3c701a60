"""Controllers choose, each step, which drafter proposes and how many tokens k.

``GoodputController`` (SmartSpec/TurboSpec, arXiv 2406.14066): over every drafter's options, the
(drafter, k) maximising goodput(k) = E[tokens | k, α_d] / (k·t_draft,d + t_verify(k+1)), with t_*
measured (``CostTable``) and α_d from that drafter's online ``AcceptanceEstimator``; k = 0 is a plain
decoding step. With one drafter this is the adaptive method; with a draft model and prompt lookup it
is hybrid drafting (an n-gram proposal is verified only up to the k the goodput picks).
A k > 0 must beat plain decoding by ``min_gain`` (default 3%): estimates of α and costs are noisy,
and a marginal predicted gain is not worth the risk of losing to plain decoding.
With a TPOT service-level objective ``tpot_slo_ms`` (AdaSpec, arXiv 2503.05096, SLO-aware selection),
choices whose predicted time per output token, step time / E[tokens] (ms/token), exceeds it are
excluded before goodput is compared; when no choice meets it, the one with the lowest predicted TPOT
is taken (best effort). The TPOT is the steady-state one: a drafter's one-off catch-up is left out.
At batch size 1 the TPOT is 1 / (goodput before amortising catch-up), so the SLO changes a decision
only where ``min_gain`` or a catch-up cost made the goodput pick a slower-per-token choice.
With ``hindsight``, a costless drafter (prompt lookup) also learns α on the steps it was not verified,
from its proposal scored against the tokens the step emitted (``hindsight``).
``FixedController``: always k from the first drafter (capped by what it offers and the budget).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from .acceptance import AcceptanceEstimator, AcceptancePrior, observe_drafters
from .cost_tracking import TrackedCosts
from .costs import CostTable, DrafterCosts
from .goodput import expected_tokens, goodput, horizon_goodput, step_time_ms
from .hindsight import HindsightTrial
from .target_confidence import TargetConfidenceMap, judged_positions


@dataclass(frozen=True)
class DraftOption:
    """What drafter ``drafter`` (an index) offers this step: up to ``k_upper`` tokens, after first
    ingesting ``catchup_tokens`` it has not seen."""

    drafter: int
    k_upper: int
    catchup_tokens: int = 0


@dataclass(frozen=True)
class Decision:
    """The chosen drafter and k, its α estimate and predicted goodput (tokens/s; NaN if unknown)."""

    k: int
    drafter: int
    alpha: float
    predicted_goodput: float


@dataclass(frozen=True)
class Candidate:
    """A possible decision with its predicted time per output token (ms/token)."""

    decision: Decision
    tpot_ms: float

    @property
    def rate(self) -> float:
        """Predicted goodput (tokens/s)."""
        return self.decision.predicted_goodput


def select_decision(
    plain: Candidate, others: Sequence[Candidate], min_gain: float = 0.0, tpot_slo_ms: float | None = None
) -> Decision:
    """The candidate of highest predicted goodput among those meeting the TPOT SLO; ties keep the earlier.

    ``plain`` is the fallback (a plain step, or the shorter proposal); another candidate must beat its
    goodput by the relative margin ``min_gain`` — unless ``plain`` itself breaks the SLO. With no
    candidate meeting ``tpot_slo_ms`` (ms/token), the one with the lowest predicted TPOT (best effort).
    """
    def meets(c: Candidate) -> bool:
        return tpot_slo_ms is None or c.tpot_ms <= tpot_slo_ms

    best = plain if meets(plain) else None
    floor = plain.rate * (1.0 + min_gain) if best is not None else 0.0
    for c in others:
        if meets(c) and c.rate > floor and (best is None or c.rate > best.rate):
            best = c
    if best is None:
        return min((plain, *others), key=lambda c: c.tpot_ms).decision
    return best.decision


def iid_candidates(opt: DraftOption, alpha: float, cost: DrafterCosts, t_verify_ms: Callable[[int], float],
                   horizon: int = 1) -> list[Candidate]:
    """Drafter ``opt.drafter``'s proposals k = 1..k_upper under i.i.d. acceptance α: goodput (tokens/s,
    its catch-up amortised over ``horizon`` tokens) and steady-state TPOT (ms/token) each."""
    out = []
    for k in range(1, opt.k_upper + 1):
        rate = horizon_goodput(goodput(alpha, k, cost.draft_ms, t_verify_ms), opt.catchup_tokens * cost.catchup_ms,
                               horizon)
        tpot = step_time_ms(k, cost.draft_ms, t_verify_ms) / expected_tokens(alpha, k)
        out.append(Candidate(Decision(k, opt.drafter, alpha, rate), tpot))
    return out


class Controller(Protocol):
    """Chooses (drafter, k) each step and learns from the outcome."""

    def choose(self, options: Sequence[DraftOption], horizon: int = 1) -> Decision:
        """Pick a drafter and k ≤ its k_upper; ``horizon`` = tokens left in the budget."""
        ...

    def observe(self, drafter: int, drafted: int, accepted: int, confidences: tuple[float, ...] = ()) -> None:
        """Record that ``accepted`` of ``drafted`` tokens from ``drafter`` were accepted; ``confidences``:
        the draft's q(x_u) of each drafted token (empty for deterministic drafters)."""
        ...


class GoodputController(TrackedCosts):
    """Per-step (drafter, k) by maximum predicted goodput; k = 0 when speculation does not pay.
    ``adapt_costs``: correct the costs by realized step times (``cost_tracking``). ``target_maps``: per
    drafter, a map from the target's p_max to acceptance (``target_confidence``; None: no such signal),
    which keeps its α near what the text's predictability says while it does not draft. ``hindsight``:
    the engine passes ``observe_hindsight`` trials of costless drafters on steps they were not verified."""

    def __init__(
        self,
        costs: CostTable,
        drafters: Sequence[DrafterCosts],
        priors: Sequence[AcceptancePrior | None] | None = None,
        min_gain: float = 0.03,
        tpot_slo_ms: float | None = None,
        adapt_costs: bool = False,
        target_maps: Sequence[TargetConfidenceMap | None] | None = None,
        hindsight: bool = False,
    ) -> None:
        self._track_costs(costs, drafters, adapt_costs)
        self.hindsight = hindsight
        self.min_gain, self.tpot_slo_ms = min_gain, tpot_slo_ms
        self.estimators = [AcceptanceEstimator(p) for p in (priors or [None] * len(self.drafters))]
        self.target_maps = list(target_maps or [None] * len(self.drafters))
        self.uses_target = any(m is not None for m in self.target_maps)  # the engine reports p_max

    def choose(self, options: Sequence[DraftOption], horizon: int = 1) -> Decision:
        """Best (drafter, k) over every option's k = 1..k_upper and a plain step (ties: smaller k,
        earlier drafter); see the module docstring for ``min_gain`` and ``tpot_slo_ms``."""
        first = options[0].drafter if options else 0
        t_verify = self.costs.t_verify
        plain = Candidate(Decision(0, first, self.estimators[first].alpha, goodput(0.0, 0, 0.0, t_verify)),
                          t_verify(1))
        others = [c for opt in options for c in iid_candidates(opt, self.estimators[opt.drafter].alpha,
                                                                self.drafters[opt.drafter], t_verify, horizon)]
        return select_decision(plain, others, self.min_gain, self.tpot_slo_ms)

    def observe(self, drafter: int, drafted: int, accepted: int, confidences: tuple[float, ...] = ()) -> None:
        observe_drafters(self.estimators, drafter, drafted, accepted)

    def observe_hindsight(self, drafter: int, trial: HindsightTrial) -> None:
        """An unverified proposal's trial (``hindsight``) counts as evidence for that drafter's α."""
        self.estimators[drafter].update(trial.drafted, trial.accepted)

    def observe_target(self, drafter: int, drafted: int, accepted: int, confidences: tuple[float, ...],
                       target_top: tuple[float, ...]) -> None:
        """For each drafter with a target map: learn P(accepted | p_max) from the positions that judged
        its draft on an accepted prefix, or, on a step it did not draft, add the map's prediction at each
        kept position's p_max (``target_top``, n+1 values) as a soft trial to its α."""
        for d, tmap in enumerate(self.target_maps):
            if tmap is None:
                continue
            if d == drafter and drafted:
                m = judged_positions(drafted, accepted)
                tmap.update(target_top[:m], [1.0 if i < accepted else 0.0 for i in range(m)])
            else:
                for p in target_top:
                    self.estimators[d].add_expected(tmap.predict(p))


class FixedController:
    """Always the same k from the first drafter (a fixed-length speculation baseline)."""

    def __init__(self, k: int, costs: CostTable | None = None, draft_ms: float = 0.0) -> None:
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        self.k, self.costs, self.draft_ms = k, costs, draft_ms
        self.estimator = AcceptanceEstimator()

    def choose(self, options: Sequence[DraftOption], horizon: int = 1) -> Decision:
        opt = options[0]
        k, alpha = min(self.k, opt.k_upper), self.estimator.alpha
        rate = goodput(alpha, k, self.draft_ms, self.costs.t_verify) if self.costs else float("nan")
        return Decision(k, opt.drafter, alpha, rate)

    def observe(self, drafter: int, drafted: int, accepted: int, confidences: tuple[float, ...] = ()) -> None:
        self.estimator.update(drafted, accepted)
