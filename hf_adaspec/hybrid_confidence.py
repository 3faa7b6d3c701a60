"""Hybrid drafting with confidence-prior stopping: each step the best of a plain step, a prompt-lookup
proposal and a draft-model proposal, the draft model judged by its calibrated confidence.

Notation: p = target, q = draft. ``speculation="hybrid"`` prices both drafters with an i.i.d.
acceptance rate α per drafter (``GoodputController``). Here the draft model is priced as
``ConfidenceController`` prices it (AdaSpec, arXiv 2503.05096): along the predicted confidence path
ĉ_j = c̄^j, calibrated to P_j = P(prefix j accepted), E(k) = 1 + Σ_{j≤k} P_j, with its catch-up amortised
over the expected remaining length. Prompt lookup keeps the i.i.d. α of its own estimator, as in
"hybrid" (E(k) = (1 − α^(k+1)) / (1 − α), Leviathan et al. 2023, Eq. 1). Every candidate's goodput is
E(k) / (k·t_draft + t_verify(k+1)) (SmartSpec, arXiv 2406.14066, §4), and ``select_decision`` takes the
best (a k > 0 must beat a plain step by ``min_gain``; a TPOT SLO excludes first). When the draft model
wins, it drafts up to k_upper and the confidence stop rule ends the proposal token by token; when
prompt lookup wins, its proposal is verified only up to the k the goodput picked.

Why: the confidence signal predicts the draft model's acceptance within a request better than one α
(on Spec-Bench "confidence" measured above "adaptive", README), and prompt lookup costs nothing to draft,
so it can win the steps where the draft model's acceptance is low.
"""

from __future__ import annotations

from collections.abc import Sequence

from .acceptance import AcceptanceEstimator, AcceptancePrior
from .confidence import ConfidenceCalibrator, ConfidenceController, StopRule
from .controller import Decision, DraftOption, iid_candidates, select_decision
from .costs import CostTable, DrafterCosts
from .hindsight import HindsightTrial

DRAFT, LOOKUP = 0, 1  # drafter indices: the draft model first, prompt lookup second


class HybridConfidenceController(ConfidenceController):
    """Per step: plain, prompt lookup (k by i.i.d. goodput) or the draft model (confidence-stopped).

    ``drafters``: the draft model's costs, then prompt lookup's (ms). ``lookup_prior``: prompt lookup's α
    prior (the pair's memory; None: the estimator's default). ``target_confidence``: as in
    ``ConfidenceController``; a lookup step counts as a step without the draft model. ``recalibrate``: as
    in ``ConfidenceController``; a lookup step leaves ρ as it is. ``hindsight``: prompt lookup's α also
    learns on the steps it is not verified, from its proposal scored against the emitted tokens."""

    def __init__(
        self,
        costs: CostTable,
        drafters: Sequence[DrafterCosts],
        calibrator: ConfidenceCalibrator | None = None,
        lookup_prior: AcceptancePrior | None = None,
        min_gain: float = 0.03,
        tpot_slo_ms: float | None = None,
        adapt_costs: bool = False,
        target_confidence: bool = False,
        recalibrate: bool = False,
        hindsight: bool = False,
    ) -> None:
        if len(drafters) != 2:
            raise ValueError(f"hybrid confidence needs two drafters (draft model, prompt lookup), got {len(drafters)}")
        super().__init__(costs, drafters[DRAFT], calibrator, min_gain, tpot_slo_ms, adapt_costs=adapt_costs,
                         target_confidence=target_confidence, recalibrate=recalibrate)
        self._track_costs(costs, drafters, adapt_costs)
        self.lookup = AcceptanceEstimator(lookup_prior)
        self.hindsight = hindsight

    def choose(self, options: Sequence[DraftOption], horizon: int = 1) -> Decision:
        """The best of a plain step, the draft model's confidence path and prompt lookup's k = 1..k_upper."""
        draft, lookup = options[DRAFT], options[LOOKUP]
        plain, longer = self._path_candidates(draft, horizon)
        lookups = iid_candidates(lookup, self.lookup.alpha, self.drafters[LOOKUP], self.costs.t_verify, horizon)
        best = select_decision(plain, [*longer, *lookups], self.min_gain, self.tpot_slo_ms)
        if best.k and best.drafter == LOOKUP:
            return best
        return self._draft_decision(draft, best)

    def stop_rule(self, drafter: int) -> StopRule | None:
        """The confidence stop rule for the draft model; None for prompt lookup (verified up to its k)."""
        return super().stop_rule(drafter) if drafter == DRAFT else None

    def observe(self, drafter: int, drafted: int, accepted: int, confidences: tuple[float, ...] = ()) -> None:
        """A lookup step updates lookup's α; any other step the draft's calibration. Lookup's α relaxes
        towards its prior on a plain step only (``acceptance.observe_drafters``)."""
        if drafter == LOOKUP:
            self.lookup.update(drafted, accepted)
            return
        super().observe(drafter, drafted, accepted, confidences)
        if drafted == 0:
            self.lookup.update(0, 0)

    def observe_hindsight(self, drafter: int, trial: HindsightTrial) -> None:
        """Prompt lookup's unverified proposal, scored against the emitted tokens, updates its α."""
        if drafter == LOOKUP:
            self.lookup.update(trial.drafted, trial.accepted)

    def observe_target(self, drafter: int, drafted: int, accepted: int, confidences: tuple[float, ...],
                       target_top: tuple[float, ...]) -> None:
        """``ConfidenceController.observe_target``, a lookup step passed on as one the draft did not draft."""
        if drafter == LOOKUP:
            drafted, accepted, confidences = 0, 0, ()
        super().observe_target(drafter, drafted, accepted, confidences, target_top)
