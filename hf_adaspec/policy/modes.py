"""The ``speculation=`` modes: the one place that says which drafters a mode uses, how each is built and
how each is priced.

A drafter is identified by its ``DrafterSpec`` (never by list position or a name string): its name (as
``StepRecord.drafter`` reports it), whether it costs a draft forward per column (``paid``), how it is built
for a run from a ``DrafterContext``, and how the adaptive controller prices its proposals (``acceptance``).

- "adaptive": with a draft model, the draft model (priced and stopped by its calibrated confidence, AdaSpec
  arXiv 2503.05096), prompt lookup and suffix drafting (each priced by its match length, learned by
  hindsight every step: ``match``) compete every step with a plain step (``AdaptiveController``), within the
  request's slowdown ledger (``ledger``, ε = ``max_slowdown``); without one, prompt lookup and suffix drafting.
- "fixed": always ``num_speculative_tokens`` from the draft model, else prompt lookup, optionally stopped at
  ``draft_p_min`` (a baseline).
- With a draft head (``assistant_model=hf_adaspec.load_head(path, target)``, EAGLE-3) in place of a draft
  model, the head takes the draft model's place in either mode, priced and stopped by its own calibrated
  confidence; the run records the target's features it reads.

What a pair learns across requests (the confidence calibration, the match-length tables) comes in through
``Learned``, objects the acceptance models update; each drafter's share of it is found by its memory key, a paid
drafter's by the assistant's weights (``assistant_identity``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..backend import hf_compat
from ..backend.ragged import KVCache
from ..config import ADAPTIVE, FIXED, SpeculationConfig
from ..costs.table import CostTable
from ..models.eagle3 import Eagle3Head, HeadKV
from ..proposers import Drafter, DraftModelProposer, PromptLookupProposer, SuffixMemory, SuffixProposer
from ..proposers.draft_head import DraftHeadProposer
from .acceptance import AcceptanceModel, ConfidenceAcceptance
from .confidence import CalibratorMemory
from .controller import AdaptiveController, Controller, FixedController
from .ledger import Ledger
from .match import MatchAcceptance, MatchMemory


@dataclass(frozen=True)
class Learned:
    """What the pair learned across requests, keyed per drafter: the draft's confidence calibrations and
    the costless drafters' acceptance per match length."""

    calibrators: CalibratorMemory
    matches: MatchMemory


@dataclass(frozen=True)
class DrafterContext:
    """What building a drafter for a run may use: the batch size, the config, the decoding settings the
    drafters need (logits processors, sampling, pad and EOS ids, generator), the assistant (``assistant_model``:
    a draft model or a draft head; None), the draft model's cache (None: no draft model), suffix drafting's
    memory of earlier responses and the draft head's cache (None: no draft head)."""

    batch: int
    config: SpeculationConfig
    logits_processor: object
    do_sample: bool
    pad_token_id: int
    eos_token_ids: tuple[int, ...]
    assistant: object | None
    draft_cache: KVCache | None
    suffixes: SuffixMemory
    generator: torch.Generator | None = None
    vocab_size: int = 0  # the target's logits width (0: the draft's own)
    head_cache: HeadKV | None = None


def _no_features(assistant: object | None) -> tuple[int, ...]:
    return ()


@dataclass(frozen=True)
class DrafterSpec:
    """One drafter: ``name``; ``paid`` (a draft forward per column, priced by the cost table's draft cells,
    and keyed in the learned state by the assistant's identity); ``build`` (context → drafter);
    ``acceptance`` ((batch, learned, memory key) → the controller's acceptance model); ``remembers_responses``
    (the run's prompts and outputs go to the pair's suffix memory); ``uses_draft_cache`` (it drafts with the
    draft model's KV cache, which the pair's prefix store seeds); ``uses_head_cache`` (it drafts with the draft
    head's); ``target_features`` (assistant → the target layers whose inputs it reads)."""

    name: str
    paid: bool
    build: Callable[[DrafterContext], Drafter]
    acceptance: Callable[[int, Learned, str], AcceptanceModel]
    remembers_responses: bool = False
    uses_draft_cache: bool = False
    uses_head_cache: bool = False
    target_features: Callable[[object | None], tuple[int, ...]] = _no_features

    def memory_key(self, identity: str) -> str:
        """This drafter's key in the pair's learned state: a paid one's per assistant (``identity``, the
        assistant's ``assistant_identity``), a costless one's one for all."""
        return f"{self.name}:{identity if self.paid else 0}"


def _draft_model(ctx: DrafterContext) -> Drafter:
    if ctx.draft_cache is None:
        raise ValueError("the draft model drafter needs a draft model (assistant_model=...)")
    narrower = ctx.vocab_size and hf_compat.vocab_size(ctx.assistant) < ctx.vocab_size
    return DraftModelProposer(
        ctx.draft_cache,
        ctx.logits_processor,
        ctx.do_sample,
        ctx.pad_token_id,
        ctx.eos_token_ids,
        ctx.generator,
        (hf_compat.vocab_size(ctx.assistant), ctx.vocab_size) if narrower else None,
    )


def _draft_head(ctx: DrafterContext) -> Drafter:
    if not isinstance(ctx.assistant, Eagle3Head) or ctx.head_cache is None:
        raise ValueError("the draft head drafter needs a head (assistant_model=hf_adaspec.load_head(path, target))")
    return DraftHeadProposer(
        ctx.assistant,
        ctx.batch,
        ctx.head_cache,
        ctx.logits_processor,
        ctx.do_sample,
        ctx.pad_token_id,
        ctx.eos_token_ids,
        ctx.generator,
    )


def _head_features(assistant: object | None) -> tuple[int, ...]:
    return tuple(assistant.config.aux_layers) if isinstance(assistant, Eagle3Head) else ()


def _by_confidence(batch: int, learned: Learned, key: str) -> AcceptanceModel:
    return ConfidenceAcceptance(batch, learned.calibrators.calibrator_for(key))


def _by_match_length(batch: int, learned: Learned, key: str) -> AcceptanceModel:
    return MatchAcceptance(batch, learned.matches.table_for(key))


DRAFT_MODEL = DrafterSpec("draft_model", True, _draft_model, _by_confidence, uses_draft_cache=True)
DRAFT_HEAD = DrafterSpec(
    "draft_head", True, _draft_head, _by_confidence, uses_head_cache=True, target_features=_head_features
)
PROMPT_LOOKUP = DrafterSpec(
    "prompt_lookup", False, lambda ctx: PromptLookupProposer(ctx.config.prompt_lookup_max_ngram), _by_match_length
)
SUFFIX = DrafterSpec(
    "suffix", False, lambda ctx: SuffixProposer(ctx.suffixes), _by_match_length, remembers_responses=True
)


@dataclass(frozen=True)
class PolicyInputs:
    """Everything a controller is built from: the request's config, costs at b rows (``costs_for``), the
    batch size, the run's drafters in order (``drafters[d]``: (spec, memory key)) and what the pair
    learned (``learned``)."""

    config: SpeculationConfig
    costs_for: Callable[[int], CostTable]
    batch: int
    drafters: tuple[tuple[DrafterSpec, str], ...]
    learned: Learned


def _adaptive(inputs: PolicyInputs) -> Controller:
    acceptance = [spec.acceptance(inputs.batch, inputs.learned, key) for spec, key in inputs.drafters]
    ledger = Ledger(inputs.config.max_slowdown, inputs.costs_for(inputs.batch).t_verify(1))
    return AdaptiveController(
        inputs.costs_for,
        acceptance,
        [spec.paid for spec, _ in inputs.drafters],
        tpot_slo_ms=inputs.config.tpot_slo_ms,
        ledger=ledger,
    )


def _fixed(inputs: PolicyInputs) -> Controller:
    return FixedController(
        inputs.config.k_max,
        inputs.config.draft_p_min,
        inputs.costs_for,
        paid=inputs.drafters[0][0].paid,
        batch=inputs.batch,
    )


def assistant_identity(assistant: object | None) -> str:
    """What the learned state knows ``assistant_model`` by: a module's weights (``hf_compat.weights_identity``:
    two objects with equal weights share a calibration, a new model never inherits a collected one's); a
    stand-in that is not a module (the replay's draft) its class's name; "none" without one."""
    if assistant is None:
        return "none"
    if isinstance(assistant, torch.nn.Module):
        return hf_compat.weights_identity(assistant)
    kind = assistant if isinstance(assistant, type) else type(assistant)
    return f"{kind.__module__}.{kind.__qualname__}"


def assistant_kind(assistant: object | None) -> str | None:
    """What ``assistant_model`` is: "head" (an ``Eagle3Head``), "model" (a draft model) or None."""
    if assistant is None:
        return None
    return "head" if isinstance(assistant, Eagle3Head) else "model"


@dataclass(frozen=True)
class SpeculationMode:
    """One ``speculation=`` value: its drafters with a draft model, with a draft head and with neither, and
    its controller."""

    with_model: tuple[DrafterSpec, ...]
    with_head: tuple[DrafterSpec, ...]
    without: tuple[DrafterSpec, ...]
    controller: Callable[[PolicyInputs], Controller]

    def drafters(self, assistant: object | None) -> tuple[DrafterSpec, ...]:
        """The drafters a run with this ``assistant_model`` uses, in the order the controller indexes them."""
        kind = assistant_kind(assistant)
        return self.with_head if kind == "head" else self.with_model if kind == "model" else self.without


MODES: dict[str, SpeculationMode] = {
    ADAPTIVE: SpeculationMode(
        (DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX), (DRAFT_HEAD, PROMPT_LOOKUP, SUFFIX), (PROMPT_LOOKUP, SUFFIX), _adaptive
    ),
    FIXED: SpeculationMode((DRAFT_MODEL,), (DRAFT_HEAD,), (PROMPT_LOOKUP,), _fixed),
}
