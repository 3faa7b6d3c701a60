"""A controller's decision and what it carries: what the engine runs, prices and stops a step by.

Design: a ``Decision`` holds per row a drafter and k_i and carries what it was decided with: its ``Pricing``
(the cost table, which drafters are paid, their catch-up), from which ``Decision.price`` predicts the time of the
step as it ran (``step_ms``, at the widths of its ``StepOutcome``), and per drafter its ``StopRule``
(``Decision.stop``: asked by the draft chain after each drafted column). Both are pure functions of what the
decision holds (and of the request's own ledger and acceptance models, which it references): neither reads the
controller that decided it. ``Decision.rested`` marks a plain step a controller rested (no offers were built and
it is not observed). The stop rules: ``ConfidenceStop`` ends a confidence-stopped drafter's proposal once one more
column is predicted not to pay (``goodput.draft_next_column``) or, with a slowdown ledger, would not be admitted;
``PMinStop`` is the llama.cpp-style baseline (stop once a drafted token's q(x) < p_min). ``StepOutcome`` is what
a decided step did, as the decision prices it and the controller observes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..costs.table import CostTable
from ..proposers.base import StopRule
from .acceptance import ConfidenceAcceptance
from .goodput import draft_next_column
from .ledger import Ledger


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
