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
from dataclasses import dataclass
from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from . import hf_compat
from .acceptance import AcceptanceMemory, AcceptancePrior
from .controller import FixedController, GoodputController
from .costs import CostCache, CostTable
from .engine import DecodeSettings, speculative_decode
from .proposers import DraftModelProposer, PromptLookupProposer
from .stats import SpeculationStats

SPECULATION_MODES = ("adaptive", "fixed")


@dataclass(frozen=True)
class SpeculationConfig:
    """How to speculate.

    speculation: "adaptive" (goodput-chosen k per step, down to 0) or "fixed" (always
    ``num_speculative_tokens``). max_speculative_tokens: k_max for adaptive. prompt_lookup_max_ngram:
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

    @property
    def drafter_key(self) -> str:
        """Identifies the drafter for the pair's acceptance memory."""
        return f"draft:{id(self.draft_model)}" if self.draft_model is not None else "prompt_lookup"


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
    if draft is not None and hf_compat.vocab_size(draft) != hf_compat.vocab_size(model):
        raise ValueError(
            f"draft model vocabulary ({hf_compat.vocab_size(draft)}) differs from the target's "
            f"({hf_compat.vocab_size(model)}); pick a draft with the target's tokenizer, or drop "
            "assistant_model to use prompt lookup"
        )


def _build_controller(model, request: SpeculationRequest):
    config = request.config
    costs = request.costs
    if costs is None:
        log = functools.partial(print, file=sys.stderr)
        costs = CostCache().load_or_measure(model, request.draft_model, config.max_speculative_tokens + 1, log)
    if request.draft_model is None:
        costs = costs.with_draft_ms(0.0)
    if config.speculation == "fixed":
        return FixedController(config.k_max, costs)
    prior = request.memory.prior_for(request.drafter_key) if request.memory else None
    return GoodputController(costs, prior, config.min_gain)


def speculative_generate(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    adaspec_request: SpeculationRequest | None = None,
    **model_kwargs,
):
    """``custom_generate`` callable: speculative decoding with the request's drafter and controller.

    input_ids: [1, T] long. Returns sequences [1, T + new] or, with return_dict_in_generate,
    ``SpeculativeGenerateOutput`` whose ``speculation`` holds every step's decision.
    """
    request = adaspec_request or SpeculationRequest(SpeculationConfig())
    _check_inputs(model, input_ids, request, generation_config, model_kwargs)
    if request.draft_model is not None:
        eos_ids = hf_compat.eos_token_ids(generation_config)
        proposer = DraftModelProposer(request.draft_model, logits_processor, generation_config.do_sample, eos_ids)
    else:
        proposer = PromptLookupProposer(max_ngram=request.config.prompt_lookup_max_ngram)
    settings = DecodeSettings(
        logits_processor=logits_processor,
        stopping_criteria=stopping_criteria,
        max_length=generation_config.max_length,
        do_sample=generation_config.do_sample,
        k_max=request.config.k_max,
        streamer=request.streamer,
    )
    result = speculative_decode(model, input_ids, proposer, _build_controller(model, request), settings)
    if request.memory is not None:
        steps = result.stats.steps
        request.memory.record(request.drafter_key, sum(s.k for s in steps), sum(s.accepted for s in steps))
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
    request = SpeculationRequest(config, draft, kwargs.get("streamer"), costs, memory)
    return original(custom_generate=speculative_generate, adaspec_request=request, **kwargs)


def enable(model) -> Any:
    """Let ``model.generate`` take ``speculation="adaptive"|"fixed"`` (and ``assistant_model`` as the
    draft). Idempotent; returns the model. Without ``speculation`` generate is unchanged."""
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
