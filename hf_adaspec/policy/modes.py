"""The ``speculation=`` modes: a registry from each name to its drafters and controller builder.

"adaptive": with a draft model, the draft model (priced and stopped by its calibrated confidence) and
prompt lookup (i.i.d. α per row) compete every step with a plain step (``AdaptiveController``);
without one, prompt lookup alone. "fixed": always ``num_speculative_tokens`` from the first drafter
(the draft model, else prompt lookup), optionally stopped at ``draft_p_min`` (a baseline).
What a pair learns across requests (α per drafter, the confidence calibration) comes in through
``Learned``; the builder reads it, the seam records each request's outcome back into it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import SpeculationConfig
from ..costs.table import CostTable
from ..proposers.prompt_lookup import LOOKUP_START_ALPHA
from .acceptance import AcceptanceMemory
from .confidence import CalibratorMemory
from .controller import AdaptiveController, ConfidenceAcceptance, Controller, FixedController, IIDAcceptance


@dataclass(frozen=True)
class Learned:
    """What the pair learned across requests: α memory and confidence calibrations, keyed per drafter."""

    memory: AcceptanceMemory
    calibrators: CalibratorMemory


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
            prior = inputs.learned.memory.prior_for(key, start=LOOKUP_START_ALPHA)
            models.append(IIDAcceptance(inputs.batch, prior))
        paid.append(name == "draft_model")
    return AdaptiveController(inputs.costs_for, models, paid, tpot_slo_ms=inputs.config.tpot_slo_ms)


def _fixed(inputs: PolicyInputs) -> Controller:
    return FixedController(inputs.config.k_max, inputs.config.draft_p_min, inputs.costs_for,
                           paid=inputs.drafters[0][0] == "draft_model", batch=inputs.batch)


@dataclass(frozen=True)
class SpeculationMode:
    """One ``speculation=`` value: its controller builder and whether prompt lookup joins a given draft
    model as a second drafter."""

    build: Callable[[PolicyInputs], Controller]
    lookup_with_draft: bool


SPECULATION_MODES: dict[str, SpeculationMode] = {
    "adaptive": SpeculationMode(_adaptive, lookup_with_draft=True),
    "fixed": SpeculationMode(_fixed, lookup_with_draft=False),
}
