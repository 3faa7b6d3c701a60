"""The ``speculation=`` modes: a registry from each name to its controller builder and its needs.

Each builder takes the request (``integration.SpeculationRequest``: config, draft model, what the model
learned across requests), the cost table and per-drafter costs (ms), and the proposers (draft model
first, then prompt lookup), and returns the step controller. ``build_controller`` finds the costs (a
given table, else the pair's profile or a calibration) and resumes the pair's online cost ratios.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .acceptance import AcceptanceMemory, AcceptancePrior
from .confidence import CalibratorMemory, ConfidenceCalibrator, ConfidenceController, PMinController
from .controller import Controller, DrafterCosts, FixedController, GoodputController
from .costs import CostCache, CostTable
from .hybrid_confidence import HybridConfidenceController
from .proposers import DraftModelProposer, PromptLookupProposer, Proposer
from .proposers.prompt_lookup import LOOKUP_START_ALPHA

if TYPE_CHECKING:
    from .integration import SpeculationRequest


def memory_key(proposer: Proposer) -> str:
    """Identifies a drafter in the pair's acceptance memory (the draft model by identity)."""
    return f"{proposer.name}:{id(getattr(proposer, 'model', None))}"


def drafter_priors(request: SpeculationRequest, proposers: list) -> list[AcceptancePrior]:
    """Each drafter's α prior from the pair's memory (``config.alpha_prior_quantile``); a request without
    one starts as a new pair: prompt lookup at ``LOOKUP_START_ALPHA``, the draft model at the initial
    prior's upper quantile (``AcceptanceMemory.prior_for``)."""
    memory = request.memory or AcceptanceMemory()
    return [memory.prior_for(memory_key(p), request.config.alpha_prior_quantile,
                             start=LOOKUP_START_ALPHA if isinstance(p, PromptLookupProposer) else None)
            for p in proposers]


def _goodput_controller(request: SpeculationRequest, costs: CostTable, drafters: list[DrafterCosts],
                        proposers: list[Proposer]) -> Controller:
    """adaptive / hybrid: per-step (drafter, k) by predicted goodput, α priors from the pair's memory."""
    priors = drafter_priors(request, proposers)
    config, memory = request.config, request.memory or AcceptanceMemory()
    maps = [memory.target_map_for(memory_key(p)) if config.target_confidence and isinstance(p, DraftModelProposer)
            else None for p in proposers]
    return GoodputController(costs, drafters, priors, config.min_gain, config.tpot_slo_ms, _adapts(request), maps,
                             hindsight=config.lookup_hindsight)


def _fixed_controller(request: SpeculationRequest, costs: CostTable, drafters: list[DrafterCosts],
                      proposers: list[Proposer]) -> Controller:
    """fixed: always k = num_speculative_tokens."""
    return FixedController(request.config.k_max, costs, drafters[0].draft_ms)


def _calibrator(request: SpeculationRequest, proposers: list[Proposer]) -> ConfidenceCalibrator:
    """The draft model's (``proposers[0]``) confidence calibration, kept per pair across requests."""
    return (request.calibrators or CalibratorMemory()).calibrator_for(memory_key(proposers[0]))


def _confidence_controller(request: SpeculationRequest, costs: CostTable, drafters: list[DrafterCosts],
                           proposers: list[Proposer]) -> Controller:
    """confidence: AdaSpec's confidence-prior stopping, calibrated per pair across requests."""
    config = request.config
    return ConfidenceController(costs, drafters[0], _calibrator(request, proposers), config.min_gain,
                                config.tpot_slo_ms, adapt_costs=_adapts(request),
                                target_confidence=config.target_confidence, recalibrate=config.recalibrate)


def _hybrid_confidence_controller(request: SpeculationRequest, costs: CostTable, drafters: list[DrafterCosts],
                                  proposers: list[Proposer]) -> Controller:
    """hybrid-confidence: a plain step, prompt lookup or the confidence-stopped draft model, by goodput."""
    config = request.config
    return HybridConfidenceController(costs, drafters, _calibrator(request, proposers),
                                      drafter_priors(request, proposers)[1], config.min_gain, config.tpot_slo_ms,
                                      _adapts(request), config.target_confidence, config.recalibrate,
                                      hindsight=config.lookup_hindsight)


def _adapts(request: SpeculationRequest) -> bool:
    """Online cost correction: asked for, and the costs were measured here (not given as is)."""
    return request.config.adapt_costs and request.costs is None


def _pmin_controller(request: SpeculationRequest, costs: CostTable, drafters: list[DrafterCosts],
                     proposers: list[Proposer]) -> Controller:
    """pmin: llama.cpp-style stop at the first draft token with q(x_u) < draft_p_min."""
    return PMinController(request.config.draft_p_min)


@dataclass(frozen=True)
class SpeculationMode:
    """One ``speculation=`` value: its controller builder ``build(request, costs, drafter_costs,
    proposers)``, whether it needs a draft model, whether prompt lookup joins the draft model as a
    second drafter, and whether the static-batch engine runs it."""

    build: Callable[[SpeculationRequest, CostTable, list[DrafterCosts], list[Proposer]], Controller]
    needs_draft: bool = False
    lookup_with_draft: bool = False
    batch: bool = True


SPECULATION_MODES: dict[str, SpeculationMode] = {
    "adaptive": SpeculationMode(_goodput_controller),
    "fixed": SpeculationMode(_fixed_controller),
    "hybrid": SpeculationMode(_goodput_controller, needs_draft=True, lookup_with_draft=True),
    "confidence": SpeculationMode(_confidence_controller, needs_draft=True),
    "pmin": SpeculationMode(_pmin_controller, needs_draft=True, batch=False),
    "hybrid-confidence": SpeculationMode(_hybrid_confidence_controller, needs_draft=True, lookup_with_draft=True,
                                         batch=False),
}


def build_controller(model, request: SpeculationRequest, proposers: list[Proposer], context: int) -> Controller:
    """The mode's controller over the given cost table, else the pair's profile at ``context`` tokens (the
    prompt length) or its calibrated table (``CostCache.load_or_measure``)."""
    config, costs = request.config, request.costs
    if costs is None:
        log = functools.partial(print, file=sys.stderr)
        costs = CostCache().load_or_measure(model, request.draft_model, config.max_speculative_tokens + 1, log,
                                            context=context, profile=request.profile)
    drafter_costs = [
        DrafterCosts(costs.draft_ms, costs.draft_catchup_ms) if isinstance(p, DraftModelProposer) else DrafterCosts()
        for p in proposers
    ]
    controller = SPECULATION_MODES[config.speculation].build(request, costs, drafter_costs, proposers)
    scale = request.cost_scales.scale_for(scale_key(costs, proposers)) if request.cost_scales else None
    if scale is not None and hasattr(controller, "resume_costs"):
        controller.resume_costs(scale)
    return controller


def scale_key(costs: CostTable, proposers: list[Proposer]) -> str:
    """Identifies a pair and its drafters in the cost-scale memory."""
    return ":".join([costs.key, *(memory_key(p) for p in proposers)])
