"""Hindsight: how a costless drafter's whole offer would have fared against the tokens a step emitted.

A costless drafter (prompt lookup, suffix drafting) offers tokens every step whether or not it proposed; the
controller learns its acceptance from every step by comparing the offer with what the target emitted, so a
plain step teaches as much about it as a speculative one.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..policy.controller import StepView
from ..proposers.base import DraftOffer


def hindsight(proposal: Sequence[int], emitted: Sequence[int]) -> tuple[int, int]:
    """(compared, accepted): how many of a costless drafter's u tokens can be checked against the m tokens a
    step emitted (min(u, m)), and how many leading ones equal them."""
    compared = min(len(proposal), len(emitted))
    return compared, next((j for j in range(compared) if proposal[j] != emitted[j]), compared)


def scored(
    offers: Sequence[DraftOffer], view: StepView, new: Sequence[Sequence[int]]
) -> tuple[tuple[tuple[int, int], ...] | None, ...]:
    """Per drafter: None (paid), or for a costless one per row what its whole offer (as the controller saw
    it, capped by the row's budget) would have got accepted (``new``: per row the emitted token ids)."""
    return tuple(
        tuple(hindsight(t[:u].tolist(), e) for t, u, e in zip(o.tokens, view.bounds[d], new, strict=True))
        if o.costless
        else None
        for d, o in enumerate(offers)
    )
