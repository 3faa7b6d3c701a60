"""Controllers: each step, which drafter proposes for each row and how many tokens k_i.

The contract the engine drives (``Controller``), at any batch size B (a single request is B = 1):
``decide(batch, view)`` → a ``Decision``: ``view`` is a zero-argument callable that builds the step's
``StepView`` (every drafter's offer: it costs engine time), and a controller that rests the step returns a
rested plain decision without calling it (``Decision.rested``: no offers, nothing observed). A decision
carries what it was decided with: its ``Pricing`` (the cost table, which drafters are paid, their catch-up),
from which ``Decision.price`` predicts the time of the step as it ran, and per drafter its ``StopRule``
(``Decision.stop``: asked by the draft chain after each drafted column). Both are pure functions of what
the decision holds (and of the request's own ledger and acceptance models, which it references): neither
reads the controller. Then ``observe(decision, outcome)`` (a decided step's ``StepOutcome``),
``account`` (every step's time and tokens, rested ones included), ``may_explore`` and ``select`` (finished
rows leave). Nothing else is probed.

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
from ..proposers.base import StopRule
from .acceptance import AcceptanceModel, ConfidenceAcceptance, IIDAcceptance
from .goodput import DrafterPaths, best_plan, draft_next_column, expected_tokens, step_time_ms
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


@dataclass(frozen=True)
class StepOutcome:
    """What a step did per row: drafter index, tokens drafted (k_i), accepted (n_i ≤ k_i) and the draft's
    q(x_u) of each drafted token (empty for deterministic drafters); ``hindsight[d]``: for a costless drafter
    d, per row (compared, accepted) of its whole offer against the emitted tokens (None: not costless;
    empty: not given); ``decision_ms``: the engine's time for the step's offers, decision and hindsight
    (ms; NaN: not measured)."""

    drafters: tuple[int, ...]
    ks: tuple[int, ...]
    accepted: tuple[int, ...]
    confidences: tuple[tuple[float, ...], ...]
    hindsight: tuple[tuple[tuple[int, int], ...] | None, ...] = ()
    decision_ms: float = math.nan


def step_ms(
    costs: CostTable, paid: Sequence[bool], catchup: Sequence[int], outcome: StepOutcome
) -> tuple[float, float]:
    """Predicted (draft, verification) time in ms of the step ``outcome`` ran, at its realized widths: per
    paid drafter used, its widest row's k_i draft tokens and its ``catchup[d]`` ingested columns; the target's
    forward over max_i k_i + 1 new tokens per row (SmartSpec, arXiv 2406.14066, §4.2: k·t_draft + t_verify(k+1))."""
    draft = 0.0
    for d in {d for d, k in zip(outcome.drafters, outcome.ks, strict=True) if k and paid[d]}:
        widest = max(k for e, k in zip(outcome.drafters, outcome.ks, strict=True) if e == d)
        draft += widest * costs.draft_ms + catchup[d] * costs.draft_catchup_ms
    return draft, costs.t_verify(max(outcome.ks) + 1)


@dataclass(frozen=True)
class Pricing:
    """What a decision priced its step with: ``costs`` (the ``CostTable`` at the step's batch size),
    ``paid[d]`` (whether drafter d costs a draft forward) and ``catchup[d]`` (the columns drafter d ingests
    before drafting)."""

    costs: CostTable
    paid: tuple[bool, ...]
    catchup: tuple[int, ...]

    def price(self, outcome: StepOutcome) -> float:
        """The step's predicted draft + verification time (ms) at the widths it ran (``step_ms``)."""
        return sum(step_ms(self.costs, self.paid, self.catchup, outcome))


@dataclass(frozen=True)
class Decision:
    """Per row its proposal length k_i and drafter index, the chosen drafter's predicted acceptance of
    its first token (NaN when not estimated), and the predicted goodput (tokens/s; NaN when not predicted);
    what it was decided with: ``pricing`` (None: no cost model) and ``stops[d]``, drafter d's stop rule
    (None: it drafts its k_i; empty: none for any drafter); ``rested``: a plain step the controller rested
    (no offers were made, and it is not observed)."""

    ks: tuple[int, ...]
    drafters: tuple[int, ...]
    alphas: tuple[float, ...]
    predicted_goodput: float
    pricing: Pricing | None = None
    stops: tuple[StopRule | None, ...] = ()
    rested: bool = False

    @classmethod
    def plain(cls, batch: int, pricing: Pricing | None = None, rested: bool = False) -> Decision:
        """A plain step for ``batch`` rows, not predicted (``rested``: what a rest decides)."""
        return cls((0,) * batch, (0,) * batch, (math.nan,) * batch, math.nan, pricing, (), rested)

    def stop(self, drafter: int) -> StopRule | None:
        """The rule that may end drafter ``drafter``'s proposal early (None: it drafts its k_i)."""
        return self.stops[drafter] if self.stops else None

    def price(self, outcome: StepOutcome) -> float:
        """The step's predicted draft + verification time (ms) at the widths it ran, by this decision's
        ``pricing`` (NaN: no cost model)."""
        return math.nan if self.pricing is None else self.pricing.price(outcome)


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


@dataclass(frozen=True)
class ConfidenceStop:
    """A confidence-stopped drafter's stop rule for one decision: stop once one more column is predicted not
    to pay (``draft_next_column`` at the decision's ``costs``) or, with a ``ledger``, once the step with it
    would not be admitted (its drafting rows' pessimistic tokens; ``setup_ms``: the drafter's catch-up)."""

    model: ConfidenceAcceptance
    costs: CostTable
    setup_ms: float
    ledger: Ledger | None

    def __call__(self, j: int, confidences: Sequence[tuple[float, ...]], growing: Sequence[bool]) -> bool:
        model = self.model
        probs = [model.drafted(c) for c in confidences]
        nxt = [model.next_prob(i, c) if g else 0.0 for i, (c, g) in enumerate(zip(confidences, growing))]
        return not (
            draft_next_column(probs, nxt, self.costs.draft_ms, self.costs.t_verify)
            and self._column_admitted(confidences, growing)
        )

    def _column_admitted(self, confidences: Sequence[tuple[float, ...]], growing: Sequence[bool]) -> bool:
        """Whether the ledger admits the step with one more drafted column: (j + 1) draft tokens, the
        setup and t_verify(j + 2) against the fewest pessimistic tokens of the drafting rows (each its
        drafted prefixes' and its next token's lower bounds). True without a ledger."""
        if self.ledger is None:
            return True
        model, costs = self.model, self.costs
        j = max(len(c) for c in confidences)
        floors = [
            1.0 + sum(model.drafted(c, lower=True)) + (model.next_prob(i, c, lower=True) if g else 0.0)
            for i, (c, g) in enumerate(zip(confidences, growing))
        ]
        return self.ledger.admits((j + 1) * costs.draft_ms + self.setup_ms + costs.t_verify(j + 2), min(floors))


@dataclass(frozen=True)
class PMinStop:
    """The llama.cpp-style stop: drafting ends once every growing row's last drafted token has q(x) < ``p_min``."""

    p_min: float

    def __call__(self, j: int, confidences: Sequence[tuple[float, ...]], growing: Sequence[bool]) -> bool:
        return all(not c or c[-1] < self.p_min for c, g in zip(confidences, growing) if g)


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
