"""``model.generate(..., speculation="adaptive")``: the transformers integration.

Seam: transformers 5.x ``generate(custom_generate=callable)`` prepares the generation config, logits
processors and stopping criteria, then calls the callable — but forwards to it neither
``assistant_model`` nor ``streamer`` (only keyword arguments its signature adds beyond ``_sample``'s).
``enable(model)`` therefore wraps the instance's ``generate`` (the same mechanism transformers uses for
Hub ``custom_generate`` recipes): with ``speculation=...`` it packs the draft model, streamer and
settings into one ``SpeculationRequest`` keyword and calls the original ``generate`` with our
callable; without it, ``generate`` behaves exactly as before (including HF assisted generation).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import hf_compat
from .acceptance import AcceptanceMemory
from .batch_confidence import BatchConfidenceController
from .batch_controller import BatchFixedController, BatchGoodputController
from .batch_engine import speculative_decode_batch
from .confidence import CalibratorMemory
from .config import SpeculationConfig
from .cost_tracking import CostScaleMemory
from .costs import CostCache, CostTable
from .draft_prefix import DraftPrefixStore
from .engine import DecodeSettings, speculative_decode
from .horizon import LengthMemory, lindy_horizon
from .modes import SPECULATION_MODES, build_controller, drafter_priors, memory_key, scale_key
from .proposers import DraftModelProposer, PromptLookupProposer, Proposer
from .proposers.batch_draft_model import BatchDraftModelProposer
from .proposers.batch_prompt_lookup import BatchPromptLookupProposer
from .stats import BatchSpeculationStats, SpeculationStats, StepRecord


@dataclass(frozen=True)
class SpeculationRequest:
    """Everything ``generate`` would otherwise drop before our callable: draft model and streamer."""

    config: SpeculationConfig
    draft_model: torch.nn.Module | None = None
    streamer: Any = None
    costs: CostTable | None = None
    memory: AcceptanceMemory | None = None
    on_step: Callable[[StepRecord | None, torch.Tensor], None] | None = None
    calibrators: CalibratorMemory | None = None
    profile: str | Path | None = None
    cost_scales: CostScaleMemory | None = None
    lengths: LengthMemory | None = None
    draft_prefixes: DraftPrefixStore | None = None

    def horizon(self, generated: int, tokens_left: int) -> int:
        """Tokens still to come: learned from the model's past requests (``lengths``, when
        ``config.learn_horizon``; their mean, or ``config.horizon_quantile``), else ``lindy_horizon``."""
        if self.lengths is None or not self.config.learn_horizon:
            return lindy_horizon(generated, tokens_left)
        return self.lengths.horizon(generated, tokens_left, self.config.horizon_quantile)


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only output plus ``speculation``: the request's SpeculationStats
    (``BatchSpeculationStats`` for a batch)."""

    speculation: SpeculationStats | BatchSpeculationStats | None = None


def _check_inputs(model, input_ids: torch.Tensor, request: SpeculationRequest, gen_config, kw: dict) -> None:
    """Raise ValueError for inputs the engine does not support, naming the fix."""
    if gen_config.num_beams != 1 or gen_config.num_return_sequences != 1:
        raise ValueError("speculation supports num_beams=1 and num_return_sequences=1")
    if gen_config.output_scores or gen_config.output_logits or gen_config.output_attentions:
        raise ValueError("speculation does not return scores, logits or attentions; drop output_scores/output_logits")
    draft, mode = request.draft_model, request.config.speculation
    if draft is None and SPECULATION_MODES[mode].needs_draft:
        raise ValueError(f'speculation="{mode}" needs a draft model: pass assistant_model=draft')
    if draft is not None and hf_compat.vocab_size(draft) != hf_compat.vocab_size(model):
        raise ValueError(
            f"draft model vocabulary ({hf_compat.vocab_size(draft)}) differs from the target's "
            f"({hf_compat.vocab_size(model)}); pick a draft with the target's tokenizer, or drop "
            "assistant_model to use prompt lookup"
        )
    if _is_batch(input_ids, kw):
        if not SPECULATION_MODES[mode].batch:
            raise ValueError(f'speculation="{mode}" supports batch size 1; use "adaptive", "hybrid", "confidence" '
                             'or "fixed" for batches')
        if request.config.tpot_slo_ms is not None:
            raise ValueError("tpot_slo_ms supports batch size 1; drop it for batches")
        _check_batch(input_ids, _attention_mask(input_ids, kw), request)


def _is_batch(input_ids: torch.Tensor, kw: dict) -> bool:
    """More than one row, or a padded row: the static-batch engine runs it."""
    mask = kw.get("attention_mask")
    return input_ids.shape[0] > 1 or (mask is not None and not bool(mask.all()))


def _attention_mask(input_ids: torch.Tensor, kw: dict) -> torch.Tensor:
    """The 2-D attention mask [B, T] (all ones when generate passes none: rows of equal length)."""
    mask = kw.get("attention_mask")
    if mask is None:
        return torch.ones_like(input_ids)
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    return mask


def _check_batch(input_ids: torch.Tensor, mask: torch.Tensor, request: SpeculationRequest) -> None:
    """Batched inputs must be left-padded and non-empty, without a streamer or step callback."""
    empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt(s) {empty} of the batch are empty; every prompt needs at least one token")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("the batch is right-padded; speculation needs left padding: set "
                         "tokenizer.padding_side = 'left' before tokenizing the prompts")
    if request.streamer is not None or request.on_step is not None:
        raise ValueError("streamer and speculation_callback support batch size 1; drop them for batches")


def _build_proposers(request: SpeculationRequest, logits_processor, generation_config, batch: int | None = None,
                     pad: int = 0, draft_cache: object | None = None) -> list:
    """Draft model (if given; ``draft_cache``: its starting cache at batch size 1), then prompt lookup (if
    no draft model, or for hybrid drafting); the static-batch versions when ``batch`` rows are given
    (``pad``: the pad id for ragged draft blocks)."""
    proposers: list = []
    if request.draft_model is not None:
        eos_ids = hf_compat.eos_token_ids(generation_config)
        do_sample = generation_config.do_sample
        proposers.append(DraftModelProposer(request.draft_model, logits_processor, do_sample, eos_ids,
                                            cache=draft_cache) if batch is None
                         else BatchDraftModelProposer(request.draft_model, batch, logits_processor, do_sample, pad,
                                                      eos_ids))
    if request.draft_model is None or SPECULATION_MODES[request.config.speculation].lookup_with_draft:
        lookup = PromptLookupProposer if batch is None else BatchPromptLookupProposer
        proposers.append(lookup(max_ngram=request.config.prompt_lookup_max_ngram))
    return proposers


def _remember(memory: AcceptanceMemory, proposers: list[Proposer], stats: SpeculationStats) -> None:
    """Blend this request's per-drafter acceptance into the pair's memory."""
    for p in proposers:
        steps = [s for s in stats.steps if s.drafter == p.name]
        memory.record(memory_key(p), sum(s.k for s in steps), sum(s.accepted for s in steps))


def _batch_costs(model, request: SpeculationRequest, batch: int, context: int) -> Callable[[int], CostTable]:
    """costs_for(b): the given table; else the pair's profile at b rows and ``context`` tokens (the padded
    prompt length), or tables calibrated at b = 1, 2, 4, … and ``batch`` (``CostCache.costs_for``)."""
    if request.costs is not None:
        return lambda b: request.costs
    log = functools.partial(print, file=sys.stderr)
    n_max = request.config.max_speculative_tokens + 1
    return CostCache().costs_for(model, request.draft_model, n_max, log, batch, context, request.profile)


def _generate_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, request, mask):
    """The static-batch engine with the request's drafters and controller."""
    batch, config = input_ids.shape[0], request.config
    pad = hf_compat.pad_token_id(generation_config)
    proposers = _build_proposers(request, logits_processor, generation_config, batch, pad)
    if config.speculation == "fixed":
        controller = BatchFixedController(config.k_max)
    else:
        priors = drafter_priors(request, proposers)
        kinds = [isinstance(p, BatchDraftModelProposer) for p in proposers]
        costs_for = _batch_costs(model, request, batch, input_ids.shape[1])
        controller = BatchGoodputController(costs_for, batch, kinds, priors, config.min_gain)
        if config.speculation == "confidence":
            calibrator = (request.calibrators or CalibratorMemory()).calibrator_for(memory_key(proposers[0]))
            controller = BatchConfidenceController(controller, calibrator, costs_for)
    settings = DecodeSettings(logits_processor, stopping_criteria, generation_config.max_length,
                              generation_config.do_sample, config.k_max, horizon=request.horizon)
    result = speculative_decode_batch(model, input_ids, mask, proposers, controller, settings, pad)
    if request.lengths is not None:
        for generated in result.stats.new_tokens:  # one finished request per row
            request.lengths.record(generated)
    if request.memory is not None:
        for p in proposers:
            pairs = [(k, n) for s in result.stats.steps for k, n, d in zip(s.ks, s.accepted, s.drafters) if d == p.name]
            request.memory.record(memory_key(p), sum(k for k, _ in pairs), sum(n for _, n in pairs))
    return result


def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    adaspec_request: SpeculationRequest | None = None,
    **model_kwargs,
):
    """``custom_generate`` callable: speculative decoding with the request's drafters and controller.

    input_ids: [B, T] long (B > 1 or padded rows: the static-batch engine, left padding required). Returns
    sequences [B, T + new] (finished rows right-padded with the pad id) or, with return_dict_in_generate,
    ``SpeculativeGenerateOutput`` whose ``speculation`` holds every step's decision.
    """
    request = adaspec_request or SpeculationRequest(SpeculationConfig())
    _check_inputs(model, input_ids, request, generation_config, model_kwargs)
    if _is_batch(input_ids, model_kwargs):
        result = _generate_batch(model, input_ids, logits_processor, stopping_criteria, generation_config, request,
                                 _attention_mask(input_ids, model_kwargs))
        if generation_config.return_dict_in_generate:
            return SpeculativeGenerateOutput(sequences=result.sequences, speculation=result.stats)
        return result.sequences
    store = request.draft_prefixes if request.config.reuse_draft_prefix and request.draft_model is not None else None
    seed = store.seed(request.draft_model, input_ids) if store is not None else None  # the draft's starting cache
    proposers = _build_proposers(request, logits_processor, generation_config,
                                 draft_cache=seed.cache if seed is not None else None)
    settings = DecodeSettings(
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        max_length=generation_config.max_length,
        do_sample=generation_config.do_sample,
        k_max=request.config.k_max,
        streamer=request.streamer,
        on_step=request.on_step,
        horizon=request.horizon,
    )
    controller = build_controller(model, request, proposers, input_ids.shape[1])
    result = speculative_decode(model, input_ids, proposers, controller, settings)
    if request.lengths is not None:
        request.lengths.record(result.stats.new_tokens)
    result.stats.tpot_slo_ms = request.config.tpot_slo_ms
    if seed is not None:
        result.stats.draft_prefix_tokens = seed.length
        store.remember(request.draft_model, result.sequences, proposers[0].cache, seed.length)
    if request.cost_scales is not None and hasattr(controller, "tracker"):
        request.cost_scales.record(scale_key(controller.tracker.base, proposers), controller.tracker.scale)
    if request.memory is not None:
        _remember(request.memory, proposers, result.stats)
    if generation_config.return_dict_in_generate:
        return SpeculativeGenerateOutput(sequences=result.sequences, speculation=result.stats)
    return result.sequences


# generate() keywords that set SpeculationConfig fields of the same name
_CONFIG_KEYWORDS = tuple(f.name for f in fields(SpeculationConfig) if f.name != "speculation")


@dataclass
class SpeculationState:
    """What ``generate`` learns across requests of one model: α per drafter (``memory``), the confidence
    calibration, the cost correction's ratios, the requests' lengths and the draft's recent caches
    (``draft_prefix``). ``enable`` keeps one per model;
    ``generate(..., speculation_state=SpeculationState())`` keeps workloads (or benchmarked methods) apart."""

    memory: AcceptanceMemory = field(default_factory=AcceptanceMemory)
    calibrators: CalibratorMemory = field(default_factory=CalibratorMemory)
    cost_scales: CostScaleMemory = field(default_factory=CostScaleMemory)
    lengths: LengthMemory = field(default_factory=LengthMemory)
    draft_prefixes: DraftPrefixStore = field(default_factory=DraftPrefixStore)


def _speculative_entry(original, state: SpeculationState, speculation=None, **kwargs):
    """The wrapped ``generate``: route ``speculation=...`` calls through ``speculative_generate``, learning
    into ``state`` (or the ``speculation_state`` keyword's)."""
    given = kwargs.pop("speculation_state", None)
    if speculation is None:
        if given is not None:
            raise ValueError("speculation_state is hf-adaspec's: pass speculation=... with it, or leave it out")
        return original(**kwargs)
    state = given or state
    draft = kwargs.pop("assistant_model", None)
    given_config = {name: kwargs.pop(name) for name in _CONFIG_KEYWORDS if name in kwargs}
    config = SpeculationConfig(speculation=speculation, **given_config)  # the rest: SpeculationConfig's defaults
    costs = kwargs.pop("speculation_costs", None)
    on_step = kwargs.pop("speculation_callback", None)
    profile = kwargs.pop("speculation_profile", None)
    request = SpeculationRequest(config, draft, kwargs.get("streamer"), costs, state.memory, on_step,
                                 state.calibrators, profile, state.cost_scales, state.lengths, state.draft_prefixes)
    return original(custom_generate=speculative_generate, adaspec_request=request, **kwargs)


def enable(model) -> Any:
    """Let ``model.generate`` take ``speculation=`` one of ``SPECULATION_MODES`` ("adaptive", "fixed",
    "hybrid", "confidence", "hybrid-confidence", "pmin"; ``assistant_model`` is the draft). Idempotent;
    returns the model.
    Without ``speculation`` generate is unchanged. Acceptance, confidence calibration and the online cost
    correction's ratios are kept per (model, drafter) pair across requests, and the requests' lengths per
    model (the horizon over which a draft's catch-up is amortised, ``horizon``): one ``SpeculationState``.

    Extra keywords with ``speculation``: every ``SpeculationConfig`` field but ``speculation`` (see there:
    ``num_speculative_tokens``, ``tpot_slo_ms``, ``reuse_draft_prefix``, …),
    ``speculation_state`` (a ``SpeculationState`` to learn into instead of the model's own),
    ``speculation_costs`` (a ``CostTable``, used as is),
    ``speculation_profile`` (path of an ``hf-adaspec profile`` JSON; default $HF_ADASPEC_PROFILE, else the
    cached profile of this pair, else calibration at first use) and ``speculation_callback``:
    called as ``fn(record, tokens)`` after each step with its ``StepRecord`` (None for the prefill's
    token) and the tokens it emitted ([m] long, on CPU); ``record.token_sources()`` says how each was made.
    """
    if getattr(model, "_adaspec_enabled", False):
        return model
    original = model.generate
    state = SpeculationState()

    @functools.wraps(original)
    def generate(inputs=None, speculation=None, **kwargs):
        if inputs is not None:
            kwargs["inputs"] = inputs
        return _speculative_entry(original, state, speculation=speculation, **kwargs)

    model.generate = generate
    model._adaspec_enabled = True
    return model
