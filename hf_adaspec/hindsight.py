"""Hindsight trials for a costless drafter: after each step, score the proposal it would have made.

Prompt lookup drafts without a forward pass, so its proposal is known on every step, also on the steps
where the draft model was verified or nothing was (a plain step). The tokens the step emitted (n accepted
draft tokens and the bonus token) come from the target, so they say how many of that proposal
verification would have accepted: the length of the common prefix. Under greedy verification this is
exact. Under speculative sampling a deterministic drafter's token x is accepted with probability
min(1, p(x) / 1) = p(x) (Leviathan et al. 2023, Algorithm 1 with q one-hot; notation: p = target), and
the emitted token is distributed as p, so it equals x with that same probability: an unbiased trial.
When every compared token matches but the proposal was longer than what the step emitted, no rejection
was seen: the trial ends there (drafted = accepted = tokens compared), as ``AcceptanceEstimator`` reads it.

Why: in the hybrids prompt lookup's α is otherwise learned only from its own verified steps, so while
the draft model drafts it stays near its start prior. On Spec-Bench extraction the hybrid drafted with
the draft model where prompt lookup alone ran faster. Opt-in (``SpeculationConfig.lookup_hindsight``):
over the whole bench it measured no faster (README, Benchmark).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # annotations only: controller.py imports HindsightTrial
    from .controller import Decision, DraftOption
    from .proposers.base import Proposer


@dataclass(frozen=True)
class HindsightTrial:
    """Of ``drafted`` proposal tokens compared with the emitted ones, the first ``accepted`` matched."""

    drafted: int
    accepted: int


def hindsight_trial(proposed: torch.Tensor, emitted: torch.Tensor) -> HindsightTrial:
    """Score a proposal [L] long against the tokens a step emitted [m] long (m = n + 1 ≥ 1)."""
    compared = min(proposed.shape[0], emitted.shape[0])
    matches = (proposed[:compared] == emitted[:compared]).tolist()
    accepted = matches.index(False) if False in matches else compared
    return HindsightTrial(compared, accepted)


def unverified_proposals(proposers: Sequence[Proposer], options: Sequence[DraftOption], decision: Decision,
                         ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each costless drafter's full proposal [L] at ``ids`` [1, T], by drafter index, unless it is the one
    ``decision`` verifies (drafters with ``costless`` true: no forward pass, no state)."""
    return {o.drafter: proposers[o.drafter].propose(ids, o.k_upper).tokens[0] for o in options
            if o.k_upper and getattr(proposers[o.drafter], "costless", False)
            and not (decision.k and decision.drafter == o.drafter)}
