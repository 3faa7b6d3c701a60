"""The ``speculation=`` modes: a registry from each name to its drafters and controller builder.

"adaptive": with a draft model, the draft model (priced and stopped by its calibrated confidence) and
prompt lookup (priced by its match length, learned by hindsight every step: ``match``) compete every
step with a plain step (``AdaptiveController``); without one, prompt lookup alone. "fixed": always
``num_speculative_tokens`` from the first drafter (the draft model, else prompt lookup), optionally
stopped at ``draft_p_min`` (a baseline). What a pair learns across requests (the confidence calibration,
lookup's acceptance per match length) comes in through ``Learned``, objects the controllers update.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import SpeculationConfig
from ..costs.table import CostTable
from .confidence import CalibratorMemory
from .controller import (
    AdaptiveController,
    ConfidenceAcceptance,
    Controller,
    FixedController,
)
from .match import MatchAcceptance, MatchMemory


@dataclass(frozen=True)
class Learned:
    """What the pair learned across requests, keyed per drafter: the draft's confidence calibrations and
    prompt lookup's acceptance per match length."""

    calibrators: CalibratorMemory
    matches: MatchMemory


@dataclass(frozen=True)
class PolicyInputs:
    """Everything a controller is built from: the request's config, costs at b rows (``costs_for``), the
    batch size, the drafters in order (``drafters[d]``: (name, memory key), the draft model first) and
    what the pair learned (``learned``)."""

    config: SpeculationConfig
    costs_for: Callable[[int], CostTable]
    batch: int
    drafters: tuple[tuple[str, str], ...]
    learned: Learned


def _adaptive(inputs: PolicyInputs) -> Controller:
    models, paid = [], []
    for name, key in inputs.drafters:
        if name == "draft_model":
            models.append(ConfidenceAcceptance(inputs.batch, inputs.learned.calibrators.calibrator_for(key)))
        else:
            models.append(MatchAcceptance(inputs.batch, inputs.learned.matches.table_for(key)))
        paid.append(name == "draft_model")
    return AdaptiveController(inputs.costs_for, models, paid, tpot_slo_ms=inputs.config.tpot_slo_ms)


def _fixed(inputs: PolicyInputs) -> Controller:
    return FixedController(inputs.config.k_max, inputs.config.draft_p_min, inputs.costs_for,
                           paid=inputs.drafters[0][0] == "draft_model", batch=inputs.batch)


@dataclass(frozen=True)
class SpeculationMode:
    """One ``speculation=`` value: its controller builder, whether prompt lookup joins a given draft
    model as a second drafter, and whether suffix drafting (``proposers.suffix``, priced like prompt lookup
    by its match length) joins prompt lookup wherever prompt lookup drafts."""

    build: Callable[[PolicyInputs], Controller]
    lookup_with_draft: bool
    suffix: bool = False


SPECULATION_MODES: dict[str, SpeculationMode] = {
    "adaptive": SpeculationMode(_adaptive, lookup_with_draft=True, suffix=True),
    "fixed": SpeculationMode(_fixed, lookup_with_draft=False),
}
