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
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import hf_compat
from .acceptance import AcceptanceMemory
from .controller import DrafterCosts, FixedController, GoodputController
from .costs import CostCache, CostTable
from .engine import DecodeSettings, speculative_decode
from .proposers import DraftModelProposer, PromptLookupProposer, Proposer
from .stats import SpeculationStats, StepRecord

SPECULATION_MODES = ("adaptive", "fixed", "hybrid")


@dataclass(frozen=True)
class SpeculationConfig:
    """How to speculate.

    speculation: "adaptive" (goodput-chosen k per step, down to 0), "fixed" (always
    ``num_speculative_tokens``) or "hybrid" (each step the best of a plain step, a prompt-lookup
    proposal and a draft-model proposal by predicted goodput; needs a draft model). max_speculative_tokens: k_max for adaptive. prompt_lookup_max_ngram:
    n-gram size for the prompt-lookup drafter (used when no draft model is given). min_gain: relative
    goodput margin a k > 0 must predict over a plain step to be chosen (adaptive only).
    """

    speculation: str = "adaptive"
    num_speculative_tokens: int | None = None
    max_speculative_tokens: int = 8
    prompt_lookup_max_ngram: int = 3
    min_gain: float = 0.03

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(
                f"speculation={self.speculation!r} is not supported; use one of {SPECULATION_MODES} "
                "(or leave it out for transformers' own generate)"
            )
        if self.speculation == "fixed" and self.num_speculative_tokens is None:
            raise ValueError('speculation="fixed" needs num_speculative_tokens=k (k >= 0)')
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.min_gain < 0:
            raise ValueError(f"min_gain must be >= 0, got {self.min_gain}")
        if self.max_speculative_tokens < 1:
            raise ValueError(f"max_speculative_tokens must be >= 1, got {self.max_speculative_tokens}")

    @property
    def k_max(self) -> int:
        """Largest proposal length the controller may pick."""
        if self.speculation == "fixed":
            return self.num_speculative_tokens or 0
        return self.max_speculative_tokens


@dataclass(frozen=True)
class SpeculationRequest:
    """Everything ``generate`` would otherwise drop before our callable: draft model and streamer."""

    config: SpeculationConfig
    draft_model: torch.nn.Module | None = None
    streamer: Any = None
    costs: CostTable | None = None
    memory: AcceptanceMemory | None = None
    on_step: Callable[[StepRecord | None, torch.Tensor], None] | None = None


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only output plus ``speculation``: the request's SpeculationStats."""

    speculation: SpeculationStats | None = None


def _check_inputs(model, input_ids: torch.Tensor, request: SpeculationRequest, gen_config, kw: dict) -> None:
    """Raise ValueError for inputs the engine does not support yet, naming the fix."""
    if gen_config.num_beams != 1 or gen_config.num_return_sequences != 1:
        raise ValueError("speculation supports num_beams=1 and num_return_sequences=1")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"speculation={request.config.speculation!r} supports batch size 1 for now, got {input_ids.shape[0]}; "
            "loop over prompts, or call generate without speculation for batched decoding"
        )
    mask = kw.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("padded inputs are not supported with speculation at batch size 1; pass the unpadded prompt")
    if gen_config.output_scores or gen_config.output_logits or gen_config.output_attentions:
        raise ValueError("speculation does not return scores, logits or attentions; drop output_scores/output_logits")
    draft = request.draft_model
    if draft is None and request.config.speculation == "hybrid":
        raise ValueError('speculation="hybrid" needs a draft model: pass assistant_model=draft')
    if draft is not None and hf_compat.vocab_size(draft) != hf_compat.vocab_size(model):
        raise ValueError(
            f"draft model vocabulary ({hf_compat.vocab_size(draft)}) differs from the target's "
            f"({hf_compat.vocab_size(model)}); pick a draft with the target's tokenizer, or drop "
            "assistant_model to use prompt lookup"
        )


def _memory_key(proposer: Proposer) -> str:
    """Identifies a drafter in the pair's acceptance memory (the draft model by identity)."""
    return f"{proposer.name}:{id(getattr(proposer, 'model', None))}"


def _build_proposers(request: SpeculationRequest, logits_processor, generation_config) -> list[Proposer]:
    """Draft model (if given), then prompt lookup (if no draft model, or for hybrid drafting)."""
    proposers: list[Proposer] = []
    if request.draft_model is not None:
        eos_ids = hf_compat.eos_token_ids(generation_config)
        proposers.append(DraftModelProposer(request.draft_model, logits_processor, generation_config.do_sample, eos_ids))
    if request.draft_model is None or request.config.speculation == "hybrid":
        proposers.append(PromptLookupProposer(max_ngram=request.config.prompt_lookup_max_ngram))
    return proposers


def _build_controller(model, request: SpeculationRequest, proposers: list[Proposer]):
    config, costs = request.config, request.costs
    if costs is None:
        log = functools.partial(print, file=sys.stderr)
        costs = CostCache().load_or_measure(model, request.draft_model, config.max_speculative_tokens + 1, log)
    drafter_costs = [
        DrafterCosts(costs.draft_ms, costs.draft_catchup_ms) if isinstance(p, DraftModelProposer) else DrafterCosts()
        for p in proposers
    ]
    if config.speculation == "fixed":
        return FixedController(config.k_max, costs, drafter_costs[0].draft_ms)
    priors = [request.memory.prior_for(_memory_key(p)) if request.memory else None for p in proposers]
    return GoodputController(costs, drafter_costs, priors, config.min_gain)


def _remember(memory: AcceptanceMemory, proposers: list[Proposer], stats: SpeculationStats) -> None:
    """Blend this request's per-drafter acceptance into the pair's memory."""
    for p in proposers:
        steps = [s for s in stats.steps if s.drafter == p.name]
        memory.record(_memory_key(p), sum(s.k for s in steps), sum(s.accepted for s in steps))


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

    input_ids: [1, T] long. Returns sequences [1, T + new] or, with return_dict_in_generate,
    ``SpeculativeGenerateOutput`` whose ``speculation`` holds every step's decision.
    """
    request = adaspec_request or SpeculationRequest(SpeculationConfig())
    _check_inputs(model, input_ids, request, generation_config, model_kwargs)
    proposers = _build_proposers(request, logits_processor, generation_config)
    settings = DecodeSettings(
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        max_length=generation_config.max_length,
        do_sample=generation_config.do_sample,
        k_max=request.config.k_max,
        streamer=request.streamer,
        on_step=request.on_step,
    )
    controller = _build_controller(model, request, proposers)
    result = speculative_decode(model, input_ids, proposers, controller, settings)
    if request.memory is not None:
        _remember(request.memory, proposers, result.stats)
    if generation_config.return_dict_in_generate:
        return SpeculativeGenerateOutput(sequences=result.sequences, speculation=result.stats)
    return result.sequences


def _speculative_entry(original, memory: AcceptanceMemory, speculation=None, **kwargs):
    """The wrapped ``generate``: route ``speculation=...`` calls through ``speculative_generate``."""
    if speculation is None:
        return original(**kwargs)
    draft = kwargs.pop("assistant_model", None)
    config = SpeculationConfig(
        speculation=speculation,
        num_speculative_tokens=kwargs.pop("num_speculative_tokens", None),
        max_speculative_tokens=kwargs.pop("max_speculative_tokens", 8),
        prompt_lookup_max_ngram=kwargs.pop("prompt_lookup_max_ngram", 3),
    )
    costs = kwargs.pop("speculation_costs", None)
    on_step = kwargs.pop("speculation_callback", None)
    request = SpeculationRequest(config, draft, kwargs.get("streamer"), costs, memory, on_step)
    return original(custom_generate=speculative_generate, adaspec_request=request, **kwargs)


def enable(model) -> Any:
    """Let ``model.generate`` take ``speculation="adaptive"|"fixed"|"hybrid"`` (and ``assistant_model`` as the
    draft). Idempotent; returns the model. Without ``speculation`` generate is unchanged.

    Extra keywords with ``speculation``: ``num_speculative_tokens``, ``max_speculative_tokens``,
    ``prompt_lookup_max_ngram``, ``speculation_costs`` (a ``CostTable``) and ``speculation_callback``:
    called as ``fn(record, tokens)`` after each step with its ``StepRecord`` (None for the prefill's
    token) and the tokens it emitted ([m] long, on CPU); ``record.token_sources()`` says how each was made.
    """
    if getattr(model, "_adaspec_enabled", False):
        return model
    original = model.generate
    memory = AcceptanceMemory()

    @functools.wraps(original)
    def generate(inputs=None, speculation=None, **kwargs):
        if inputs is not None:
            kwargs["inputs"] = inputs
        return _speculative_entry(original, memory, speculation=speculation, **kwargs)

    model.generate = generate
    model._adaspec_enabled = True
    return model
