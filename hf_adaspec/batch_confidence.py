"""Confidence-prior drafting and verification for a static batch (AdaSpec, arXiv 2503.05096).

``BatchConfidenceController`` wraps the batch goodput planner (``BatchGoodputController``): the plan
decides, from the rows' α, whether this step drafts at all (k = 0 at large batches where speculation
does not pay) and which drafter each row uses. A drafting row is then offered its drafter's whole
upper bound, and the draft confidence sets the length twice:
- while drafting, the draft model's batched loop asks ``stop_rule`` after each column; the next column
  is drafted only if its predicted tokens (ĉ_{j+1} = c_j·c̄ through the pair's calibration) pay for one
  more draft forward and one more verified position per row (``should_draft_column``);
- after drafting, ``eliminate`` cuts the batch to the verified width of highest predicted goodput
  (``best_width``: token elimination), so the verify forward lands where the cost table is cheapest.
  The engine calls it for greedy decoding only: the cut depends on tokens past it, which under
  sampling would bias the kept tokens' distribution (the stop rule decides on tokens already
  drafted, a stopping time, and stays lossless).
Rows without confidences (prompt lookup) are predicted as α_i^j. The calibration (a
``ConfidenceCalibrator`` per pair, shared with batch size 1) learns from every verified draft-model row.
The stop rule counts the rows that draft with the draft model; prompt-lookup rows are judged only by
``eliminate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from .batch_controller import BatchDecision, BatchGoodputController
from .confidence import ConfidenceCalibrator, prefix_confidences
from .costs import CostTable
from .elimination import best_width, should_draft_column
from .proposers.base import Proposal
from .proposers.batch_base import BatchStopRule


class BatchConfidenceController:
    """Batch plan by goodput, draft length by calibrated confidence, verified width by token elimination.

    costs_for(b) → the ``CostTable`` at batch size b; ``plan``: the goodput planner; ``calibrator``: the
    pair's confidence calibration.
    """

    def __init__(self, plan: BatchGoodputController, calibrator: ConfidenceCalibrator,
                 costs_for: Callable[[int], CostTable]) -> None:
        self.plan, self.calibrator, self.costs_for = plan, calibrator, costs_for

    def choose(self, uppers: Sequence[Sequence[int]], catchup: Sequence[int], horizon: int = 1) -> BatchDecision:
        """The plan's decision, with each drafting row offered its drafter's upper bound uppers[d][i]."""
        decision = self.plan.choose(uppers, catchup, horizon)
        if not max(decision.ks, default=0):
            return decision
        return replace(decision, ks=tuple(uppers[d][i] for i, d in enumerate(decision.drafters)))

    def _prefix_probs(self, confidences: Sequence[float]) -> list[float]:
        """Calibrated P(prefix j accepted) for j = 1..len(confidences)."""
        return [self.calibrator.predict(c) for c in prefix_confidences(confidences)]

    def stop_rule(self, rows: int) -> BatchStopRule:
        """stop(j, confidences, growing): True when column j+1 is predicted not to pay at ``rows`` rows."""
        costs, c_bar = self.costs_for(rows), self.calibrator.token_mean

        def stop(j: int, confidences: Sequence[tuple[float, ...]], growing: Sequence[bool]) -> bool:
            probs = [self._prefix_probs(c) for c in confidences]
            nxt = [self.calibrator.predict(min(1.0, math.prod(c) * c_bar)) if g else 0.0
                   for c, g in zip(confidences, growing)]
            return not should_draft_column(probs, nxt, j * costs.draft_ms, costs.draft_ms, costs.t_verify)

        return stop

    def eliminate(self, proposals: Sequence[Proposal], drafters: Sequence[int], spent_ms: float) -> list[Proposal]:
        """Token elimination: every row cut to the ``best_width`` of the batch after ``spent_ms`` of drafting."""
        probs = []
        for i, (proposal, d) in enumerate(zip(proposals, drafters, strict=True)):
            if proposal.confidences:
                probs.append(self._prefix_probs(proposal.confidences))
            else:
                alpha = self.plan.estimators[d][i].alpha
                probs.append([alpha ** j for j in range(1, proposal.k + 1)])
        width = best_width(probs, spent_ms, self.costs_for(len(proposals)).t_verify)
        return [p.head(min(p.k, width)) for p in proposals]

    def observe(self, drafters: Sequence[int], ks: Sequence[int], accepted: Sequence[int],
                confidences: Sequence[tuple[float, ...]] = ()) -> None:
        """Update the rows' α (the plan) and the calibration from every row with confidences."""
        self.plan.observe(drafters, ks, accepted)
        for conf, n in zip(confidences, accepted):
            if conf:
                self.calibrator.update(conf, n)

    def select(self, rows: torch.Tensor) -> None:
        """Keep the per-row state of rows ``rows`` ([b] long indices)."""
        self.plan.select(rows)
