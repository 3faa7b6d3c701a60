"""Controllers: each step, which drafter proposes for each row and how many tokens k_i.

The contract the engine drives (``Controller``), at any batch size B (a single request is B = 1):
``decide(batch, view)`` → a ``Decision`` (``policy.decision``: it carries its pricing and stop rules, pure
functions of what it holds that never read the controller): ``view`` is a zero-argument callable that builds the
step's ``StepView`` (every drafter's offer: it costs engine time), and a controller that rests the step returns a
rested plain decision without calling it (``Decision.rested``: no offers, nothing observed). Then
``observe(decision, outcome)`` (a decided step's ``StepOutcome``), ``account`` (every step's time and tokens,
rested ones included), ``may_explore`` and ``select`` (finished rows leave). Nothing else is probed.

``AdaptiveController`` (SmartSpec/TurboSpec, arXiv 2406.14066; AdaSpec, arXiv 2503.05096): every drafter
prices each row's proposal by its acceptance model (``acceptance``: the match-length table for prompt lookup
and suffix drafting, the calibrated confidence path ĉ_j = c̄^j for the draft model) and ``goodput.best_plan``
picks the batch-wide k and each row's drafter, down to a plain step; a draft-model row then drafts up to its
bound and the confidence stop rule (``ConfidenceStop``, by ``goodput.draft_next_column``) ends it token by
token. With a slowdown ``ledger`` (``policy.ledger``) every plan and every further drafted column must keep the
request within (1 + ε) of plain decoding in its pessimistic outcome. In a run of plain decisions it rests
(``rest.RestSchedule``) where deciding would cost more than a small share of the steps; a rested step is
priced as the observed decision that began the rest priced a plain step.
``FixedController``: always k from the first drafter, optionally stopped llama.cpp-style once a drafted
token's q(x) < p_min (``PMinStop``; a baseline).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from ..config import _check_integer
from ..costs.table import CostTable
from .acceptance import AcceptanceModel, ConfidenceAcceptance, IIDAcceptance
from .decision import ConfidenceStop, Decision, PMinStop, Pricing, StepOutcome
from .goodput import DrafterPaths, best_plan, expected_tokens, step_time_ms
from .ledger import SLACK_TOLERANCE_MS, Ledger
from .rest import RestSchedule

MIN_GAIN = 0.03  # a k > 0 must predict 3% more goodput than a plain step: α and the costs are estimates


@dataclass(frozen=True)
class StepView:
    """What the controller sees before a step: ``bounds[d][i]`` = most tokens drafter d can draft for row
    i (capped by the row's budget), ``catchup[d]`` = columns drafter d must ingest before drafting, and
    ``horizon`` = tokens per row still to come (over which a catch-up is amortised), ``evidence[d][i]`` =
    what predicts the acceptance of that bound's tokens (prompt lookup: its match length; empty: none given)."""

    bounds: tuple[tuple[int, ...], ...]
    catchup: tuple[int, ...]
    horizon: int = 1
    evidence: tuple[tuple[int, ...], ...] = ()

    @property
    def batch(self) -> int:
        return len(self.bounds[0])


ViewFn = Callable[[], StepView]  # builds the step's view (every drafter's offer); a resting controller never calls it


class Controller(Protocol):
    """Chooses (drafter, k_i) per row each step and learns from the outcome."""

    def decide(self, batch: int, view: ViewFn) -> Decision:
        """The step's decision for ``batch`` rows; a rest (``Decision.rested``) without calling ``view``."""
        ...

    def observe(self, decision: Decision, outcome: StepOutcome) -> None:
        """What the decided (not rested) step ``decision`` did."""
        ...

    def account(self, elapsed_ms: float, emitted: int, plain: bool, predicted_ms: float) -> None:
        """Every step, rested ones too: its time (ms), the fewest tokens a row emitted, whether it was a plain
        step as plain decoding runs it, and its time as ``Decision.price`` predicted it (ms; NaN: not predicted)."""
        ...

    def may_explore(self) -> bool:
        """Whether the request can pay for one step tried outside the plan (a thread count) now."""
        ...

    def select(self, rows: torch.Tensor) -> None:
        """Keep the per-row state of rows ``rows`` ([b] long indices)."""
        ...


class AdaptiveController:
    """Per step the best of a plain step and every drafter's proposals by predicted goodput.

    ``costs_for(b)``: the ``CostTable`` at b rows; ``acceptance[d]``: drafter d's acceptance model;
    ``paid[d]``: whether drafter d costs a draft forward (the draft model) or nothing (prompt lookup);
    ``tpot_slo_ms``: a TPOT objective (ms/token) the plan and the stop rule respect where they can;
    ``ledger``: the request's slowdown ledger (None: no bound).
    """

    def __init__(
        self,
        costs_for: Callable[[int], CostTable],
        acceptance: Sequence[AcceptanceModel],
        paid: Sequence[bool],
        min_gain: float = MIN_GAIN,
        tpot_slo_ms: float | None = None,
        ledger: Ledger | None = None,
    ) -> None:
        self.costs_for, self.acceptance, self.paid = costs_for, list(acceptance), list(paid)
        self.min_gain, self.tpot_slo_ms, self.ledger = min_gain, tpot_slo_ms, ledger
        self.rest = RestSchedule()
        self._rest_pricing: Pricing | None = None  # the rest's: the observed decision's that began it

    def decide(self, batch: int, view: ViewFn) -> Decision:
        """A rest where the ``RestSchedule`` says so (``view`` not called); else ``best_plan`` over every
        drafter's paths (``_plan``)."""
        if self.rest.rests():
            return Decision.plain(batch, self._rest_pricing, rested=True)
        return self._plan(view())

    def _plan(self, view: StepView) -> Decision:
        """``best_plan`` over every drafter's paths; a confidence-stopped row is given its whole bound (the
        stop rule ends it), another row its min(k, u_i). Overspent (the ledger's slack below zero): plain."""
        costs = self.costs_for(view.batch)
        pricing, ledger = Pricing(costs, tuple(self.paid), view.catchup), self.ledger
        if ledger is not None and ledger.slack_ms < -SLACK_TOLERANCE_MS:  # overspent: plain until earned back
            return Decision(
                (0,) * view.batch,
                (0,) * view.batch,
                (math.nan,) * view.batch,
                1000.0 * view.batch / costs.t_verify(1),
                pricing,
            )
        for d, evidence in enumerate(view.evidence):
            self.acceptance[d].see(evidence)
        paths = [
            DrafterPaths(
                tuple(m.path(i, u) for i, u in enumerate(view.bounds[d])),
                costs.draft_ms if self.paid[d] else 0.0,
                view.catchup[d] * costs.draft_catchup_ms if self.paid[d] else 0.0,
                tuple(m.floor(i, u) for i, u in enumerate(view.bounds[d])) if ledger is not None else (),
            )
            for d, m in enumerate(self.acceptance)
        ]
        plan = best_plan(
            paths,
            costs.t_verify,
            view.horizon,
            self.min_gain,
            self.tpot_slo_ms,
            ledger.admits if ledger is not None else None,
        )
        ks = tuple(
            0
            if not plan.k
            else view.bounds[d][i]
            if self.acceptance[d].confidence_stopped
            else min(plan.k, view.bounds[d][i])
            for i, d in enumerate(plan.drafters)
        )
        alphas = tuple(self.acceptance[d].alpha(i) for i, d in enumerate(plan.drafters))
        stops = tuple(
            ConfidenceStop(m, costs, view.catchup[d] * costs.draft_catchup_ms, ledger)
            if isinstance(m, ConfidenceAcceptance)
            else None
            for d, m in enumerate(self.acceptance)
        )
        return Decision(ks, plan.drafters, alphas, plan.goodput, pricing, stops)

    def observe(self, decision: Decision, outcome: StepOutcome) -> None:
        """A costless drafter learns on every row from its hindsight; a paid one from the rows that drafted
        with it (their confidences); without hindsight a plain row relaxes every i.i.d. model of that row.
        First the rest schedule hears whether the step was plain and what deciding it cost, against the
        decision's t_1; a rest it begins is priced by the decision's ``pricing``."""
        pricing = self._rest_pricing = decision.pricing
        self.rest.decided(
            not any(outcome.ks), outcome.decision_ms, pricing.costs.t_verify(1) if pricing is not None else math.nan
        )
        seen = outcome.hindsight or (None,) * len(self.acceptance)
        for d, rows in enumerate(seen):
            for i, (compared, accepted) in enumerate(rows or ()):
                self.acceptance[d].observe(i, compared, accepted, ())
        for i, (d, k, n, conf) in enumerate(
            zip(outcome.drafters, outcome.ks, outcome.accepted, outcome.confidences, strict=True)
        ):
            if k and seen[d] is None:
                self.acceptance[d].observe(i, k, n, conf)
            elif not k and not outcome.hindsight:
                for m in self.acceptance:
                    m.observe(i, 0, 0, ())

    def account(self, elapsed_ms: float, emitted: int, plain: bool, predicted_ms: float) -> None:
        """The step booked in the ledger (nothing without one)."""
        if self.ledger is not None:
            self.ledger.book(elapsed_ms, emitted, plain, predicted_ms)

    def may_explore(self) -> bool:
        """Without a ledger always; with one, while its slack covers one more plain step (a try of another
        thread count is booked against the plain counterfactual, at up to about twice a step)."""
        return self.ledger is None or self.ledger.slack_ms >= self.ledger.plain_step_ms

    def select(self, rows: torch.Tensor) -> None:
        for m in self.acceptance:
            m.select(rows)


class FixedController:
    """Always k_i = min(k, u_i) from the first drafter; with ``p_min`` the llama.cpp-style stop (``PMinStop``;
    the token below p_min stays in the proposal, as in transformers' ``assistant_confidence_threshold``: its
    forward is already paid). It estimates α per row only to report it with the predicted goodput
    (``costs_for(b)``: the ``CostTable`` at b rows, None: NaN and no pricing; ``paid``: whether the first
    drafter costs a draft forward). It never rests."""

    def __init__(
        self,
        k: int,
        p_min: float | None = None,
        costs_for: Callable[[int], CostTable] | None = None,
        paid: bool = True,
        batch: int = 1,
    ) -> None:
        """Raises ValueError for a k that is not an integer >= 0, or a batch that is not an integer >= 1 (a bool
        or a float is refused)."""
        _check_integer("num_speculative_tokens", k)
        _check_integer("batch", batch)
        if k < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {k}")
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        self.k, self.p_min, self.costs_for, self.paid = k, p_min, costs_for, paid
        self.acceptance = IIDAcceptance(batch)
        self._stop = PMinStop(p_min) if p_min is not None else None

    def decide(self, batch: int, view: ViewFn) -> Decision:
        """min(k, u_i) per row from drafter 0, priced by ``costs_for`` (if given)."""
        seen = view()
        ks = tuple(min(self.k, u) for u in seen.bounds[0])
        alphas = tuple(self.acceptance.alpha(i) for i in range(seen.batch))
        rate, pricing = math.nan, None
        if self.costs_for is not None:
            costs, width = self.costs_for(seen.batch), max(ks)
            pricing = Pricing(costs, (self.paid,), (0,))
            tokens = sum(expected_tokens(a, k) for a, k in zip(alphas, ks, strict=True))
            rate = 1000.0 * tokens / step_time_ms(width, costs.draft_ms if self.paid else 0.0, costs.t_verify)
        stops = (self._stop,) * len(seen.bounds) if self._stop is not None else ()
        return Decision(ks, (0,) * seen.batch, alphas, rate, pricing, stops)

    def account(self, elapsed_ms: float, emitted: int, plain: bool, predicted_ms: float) -> None:
        """Nothing: a fixed k keeps no ledger."""

    def may_explore(self) -> bool:
        """Always: a fixed k keeps no ledger."""
        return True

    def observe(self, decision: Decision, outcome: StepOutcome) -> None:
        """Each row's α (reported, not used to decide)."""
        for i, (k, n) in enumerate(zip(outcome.ks, outcome.accepted, strict=True)):
            self.acceptance.observe(i, k, n, ())

    def select(self, rows: torch.Tensor) -> None:
        self.acceptance.select(rows)
