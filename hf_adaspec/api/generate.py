"""``model.generate(..., speculation="adaptive")``: the public entry into the engine.

transformers 5.x ``generate(custom_generate=callable)`` prepares the generation config, logits
processors and stopping criteria, then calls the callable — but forwards to it neither
``assistant_model`` nor ``streamer`` (only keyword arguments its signature adds beyond ``_sample``'s), and
it drops ``tokenizer`` before building the stop strings' criterion (``hf_compat.stop_strings_as_criteria``
builds it instead).
``enable(model)`` therefore wraps the instance's ``generate`` (the same mechanism transformers uses for
Hub ``custom_generate`` recipes): with ``speculation=...`` it packs the draft model, streamer and
settings into one ``SpeculationRequest`` keyword and calls the original ``generate`` with our
callable; without it, ``generate`` behaves exactly as before (including HF assisted generation).
The callable checks the arguments and hands the request to the engine in one call (``engine.run.run_request``:
its caches, costs, assembly, the loop, what it taught the pair); a single prompt is a batch of one row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput

from ..backend import arena_sizes, hf_compat
from ..backend.arenas import arenas_of
from ..config import SpeculationConfig
from ..costs.table import CostTable
from ..engine.owner import ModelState
from ..engine.run import SpeculationState, run_request
from ..engine.settings import DecodeSettings, predicted_time
from ..engine.stats import SpeculationStats, StepRecord
from ..policy.modes import assistant_kind


@dataclass(frozen=True)
class SpeculationRequest:
    """Everything ``generate`` would otherwise drop before our callable: the draft model, the streamer,
    the step callback, the costs (a table used as is, or a profile path) and the learned state."""

    config: SpeculationConfig
    state: SpeculationState = field(default_factory=SpeculationState)
    draft_model: torch.nn.Module | None = None
    streamer: Any = None
    costs: CostTable | None = None
    on_step: Callable[[StepRecord | None, torch.Tensor], None] | None = None
    profile: str | Path | None = None


@dataclass
class SpeculativeGenerateOutput(GenerateDecoderOnlyOutput):
    """transformers' decoder-only output plus ``speculation``: the request's ``SpeculationStats``."""

    speculation: SpeculationStats | None = None


def _check_inputs(model, input_ids: torch.Tensor, mask: torch.Tensor, request: SpeculationRequest, gen_config) -> None:
    """Raise ValueError for inputs the engine does not support, naming the fix.

    Raises:
        ValueError: beams or several sequences per prompt, per-step outputs (``_check_outputs``), a target
            or draft model with recurrent layers (``hf_compat.speculation_reason``), a draft
            with a larger vocabulary (a narrower draft head is padded: the same tokenizer), a head of another
            target, a mask of another shape, an empty or right-padded prompt, or a
            batch-size-1 feature (streamer, speculation_callback, tpot_slo_ms) with a batch.
    """
    if gen_config.num_beams != 1 or gen_config.num_return_sequences != 1:
        raise ValueError("speculation supports num_beams=1 and num_return_sequences=1")
    _check_outputs(gen_config)
    draft = request.draft_model
    for checked in (model, draft) if assistant_kind(draft) == "model" else (model,):
        if (reason := hf_compat.speculation_reason(checked)) is not None:
            raise ValueError(f"{reason}: leave speculation out (plain generate), or pick another model")
    if assistant_kind(draft) == "head" and draft.config.target_vocab_size != hf_compat.vocab_size(model):
        raise ValueError(
            f"the draft head was made for a vocabulary of {draft.config.target_vocab_size} tokens, "
            f"the target's is {hf_compat.vocab_size(model)}: load a head trained for this target"
        )
    elif assistant_kind(draft) == "model" and hf_compat.vocab_size(draft) > hf_compat.vocab_size(model):
        raise ValueError(
            f"draft model vocabulary ({hf_compat.vocab_size(draft)}) is larger than the target's "
            f"({hf_compat.vocab_size(model)}); pick a draft with the target's tokenizer, or drop "
            "assistant_model to use prompt lookup"
        )
    if mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"prompt(s) {empty} of the batch are empty; every prompt needs at least one token")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError(
            "the batch is right-padded; speculation needs left padding: set "
            "tokenizer.padding_side = 'left' before tokenizing the prompts"
        )
    if input_ids.shape[0] > 1 or not bool(mask.all()):
        if request.streamer is not None or request.on_step is not None:
            raise ValueError("streamer and speculation_callback support batch size 1; drop them for batches")
        if request.config.tpot_slo_ms is not None:
            raise ValueError("tpot_slo_ms supports batch size 1; drop it for batches")


def _check_outputs(gen_config) -> None:
    """Raise ValueError naming the per-step outputs requested (output_scores, output_logits,
    output_attentions, output_hidden_states): speculation returns sequences and its stats only."""
    requested = {
        "output_scores": gen_config.output_scores,
        "output_logits": gen_config.output_logits,
        "output_attentions": gen_config.output_attentions,
        "output_hidden_states": gen_config.output_hidden_states,
    }
    named = [f"{name}=True" for name, value in requested.items() if value]
    if named:
        raise ValueError(
            "speculation does not return scores, logits, attentions or hidden states; drop "
            + ", ".join(named)
            + " (or leave speculation out to get them from plain generate)"
        )


def _settings(model, request: SpeculationRequest, logits_processor, stopping_criteria, gen_config) -> DecodeSettings:
    """What the loop takes from the generation config and the request (on a CPU with ``adapt_threads``, the
    state's thread chooser; with ``rest=False``, decisions priced at no time and steps booked at their
    predicted time, so that no decision depends on the engine's timing)."""
    chooser = request.state.threads if request.config.adapt_threads and model.device.type == "cpu" else None
    return DecodeSettings(
        logits_processor,
        stopping_criteria,
        gen_config.max_length,
        gen_config.do_sample,
        hf_compat.pad_token_id(gen_config),
        hf_compat.eos_token_ids(gen_config),
        hf_compat.vocab_size(model),
        request.streamer,
        on_step=request.on_step,
        threads=chooser,
        decision_ms=None if request.config.rest else 0.0,
        step_ms=None if request.config.rest else predicted_time,
    )


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

    input_ids: [B, T] long, left-padded when rows differ in length (``attention_mask`` [B, T]). Returns
    sequences [B, T + new] (finished rows right-padded with the pad id) or, with
    return_dict_in_generate, ``SpeculativeGenerateOutput`` whose ``speculation`` holds every decision.
    Raises ValueError for inputs speculation cannot honour (see ``_check_inputs``).
    """
    request = adaspec_request or SpeculationRequest(SpeculationConfig())
    mask = model_kwargs.get("attention_mask")
    mask = torch.ones_like(input_ids) if mask is None else mask
    _check_inputs(model, input_ids, mask, request, generation_config)
    settings = _settings(model, request, logits_processor, stopping_criteria, generation_config)
    result = run_request(
        model,
        request.draft_model,
        request.config,
        request.state,
        input_ids,
        mask,
        settings,
        request.costs,
        request.profile,
    )
    if generation_config.return_dict_in_generate:
        return SpeculativeGenerateOutput(sequences=result.sequences, speculation=result.stats)
    return result.sequences


# generate() keywords that set SpeculationConfig fields of the same name
_CONFIG_KEYWORDS = tuple(f.name for f in fields(SpeculationConfig) if f.name != "speculation")


def _check_keywords(kwargs: dict[str, Any]) -> None:
    """Reject, before generate runs, what speculation would otherwise ignore or fail on unclearly.

    Raises:
        ValueError: a prompt with no tokens (``inputs``/``input_ids`` of length 0), or transformers' own
            assisted-generation options (``hf_compat.ASSISTED_GENERATION_OPTIONS``, ``assistant_tokenizer``).
    """
    prompt = kwargs.get("inputs", kwargs.get("input_ids"))
    if isinstance(prompt, torch.Tensor) and prompt.numel() == 0:
        raise ValueError(
            f"the prompt has no tokens (input_ids of shape {tuple(prompt.shape)}); tokenize non-empty "
            "text, or add the BOS token, e.g. tokenizer(text, add_special_tokens=True)"
        )
    assisted = hf_compat.assisted_generation_options(kwargs)
    if kwargs.get("token_healing") or (
        kwargs.get("generation_config") is not None and kwargs["generation_config"].token_healing
    ):
        raise ValueError("speculation does not support token_healing; drop it, or leave speculation out")
    if assisted:
        raise ValueError(
            f"{', '.join(assisted)} belong to transformers' assisted generation, which speculation=... replaces; "
            "drop them and use hf-adaspec's: max_speculative_tokens (cap on drafted tokens per step), "
            "prompt_lookup_max_ngram (prompt lookup's n-gram size, drafting without assistant_model), or "
            'speculation="fixed" with num_speculative_tokens (a fixed number per step); the draft model must '
            "share the target's tokenizer. Or leave speculation out for transformers' assisted generation"
        )


def _speculative_entry(original, owner: ModelState, speculation=None, **kwargs):
    """The wrapped ``generate`` (``original``: the model's own, bound): route ``speculation=...`` calls
    through ``speculative_generate`` as one request of ``owner`` (the model's ``ModelState``: the models held,
    speculation's attention swapped in for the request), learning into ``owner.learned`` (or the
    ``speculation_state`` keyword's); other calls go to ``original`` as they are. Stop strings with a
    ``tokenizer`` become a stopping criterion here (``hf_compat.stop_strings_as_criteria``).

    Raises:
        ValueError: speculation_state without speculation, an empty prompt, transformers' assisted-generation
            options with speculation (``_check_keywords``), or invalid settings (``SpeculationConfig``).
        RuntimeError: a speculative generate started inside another on the same model (``ModelState.request``).
    """
    given = kwargs.pop("speculation_state", None)
    if speculation is None:
        if given is not None:
            raise ValueError("speculation_state is hf-adaspec's: pass speculation=... with it, or leave it out")
        return original(**kwargs)
    _check_keywords(kwargs)
    kwargs = hf_compat.stop_strings_as_criteria(original.__self__, kwargs)
    given_config = {name: kwargs.pop(name) for name in _CONFIG_KEYWORDS if name in kwargs}
    config = SpeculationConfig(speculation=speculation, **given_config)  # the rest: SpeculationConfig's defaults
    draft = kwargs.pop("assistant_model", None)
    costs, on_step, profile = (
        kwargs.pop(k, None) for k in ("speculation_costs", "speculation_callback", "speculation_profile")
    )
    device, kwargs = _prompt_on_cpu(kwargs)
    with owner.request(draft, given) as learned:
        request = SpeculationRequest(config, learned, draft, kwargs.get("streamer"), costs, on_step, profile)
        result = original(custom_generate=speculative_generate, adaspec_request=request, **kwargs)
    if isinstance(result, torch.Tensor):
        return result.to(device)
    result.sequences = result.sequences.to(device)
    return result


_PROMPT_KEYWORDS = ("inputs", "input_ids", "attention_mask")


def _prompt_on_cpu(kwargs: dict[str, Any]) -> tuple[torch.device, dict[str, Any]]:
    """The prompt's device, and the keywords with the prompt tensors on the CPU: the engine keeps its
    bookkeeping (and transformers its logits processors and stopping criteria) there; ``hf_compat``'s
    forwards move each model's inputs to that model's device. Sequences go back to the prompt's device."""
    tensors = [kwargs[k] for k in _PROMPT_KEYWORDS if isinstance(kwargs.get(k), torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    return device, {
        k: v.cpu() if k in _PROMPT_KEYWORDS and isinstance(v, torch.Tensor) else v for k, v in kwargs.items()
    }


def enable(model) -> Any:
    """Let ``model.generate`` take ``speculation="adaptive"`` or ``"fixed"`` (``assistant_model`` is the
    draft). Idempotent; returns the model. Without ``speculation`` generate is transformers' own, its attention
    included. A speculative request runs the model's "sdpa" attention as ``hf_compat.use_packed_attention``'s
    (the same SDPA computation, its grouped-query heads packed on a CPU) and a q4 model's attention modules as
    ``hf_compat.use_lean_attention``'s (the same values, the rotary embedding in one C call), a draft model passed
    as ``assistant_model`` alike, swapped in for the request and out after it (``hf_compat.speculative_attention``).
    Everything kept for the model across requests (its arenas, what it learns: the confidence calibration and
    α per drafter keyed by the draft's weights, the draft's recent caches, the thread chooser) has one owner, an
    ``engine.owner.ModelState`` made here; one speculative request runs on the model at a time (another
    thread's waits; one started from inside a request's streamer or callback raises RuntimeError).

    Extra keywords with ``speculation``: every ``SpeculationConfig`` field but ``speculation``
    (``num_speculative_tokens``, ``max_speculative_tokens``, ``prompt_lookup_max_ngram``, ``tpot_slo_ms``,
    ``draft_p_min``), ``speculation_state`` (a ``SpeculationState`` to learn into instead of the model's
    own, ``ModelState.learned``), ``speculation_costs`` (a ``CostTable``, used as is), ``speculation_profile``
    (path of an ``hf-adaspec profile`` JSON; default $HF_ADASPEC_PROFILE, else the cached profile of this pair,
    else calibration at first use) and ``speculation_callback``: called as ``fn(record, tokens)`` after each
    step with its ``StepRecord`` (None for the prefill's token) and the tokens it emitted ([m] long, on
    CPU); ``record.token_sources()`` says how each was made.
    """
    if getattr(model, "_adaspec_enabled", False):
        return model
    original = model.generate
    owner = ModelState(model)

    @functools.wraps(original)
    def generate(inputs=None, speculation=None, **kwargs):
        if inputs is not None:
            kwargs["inputs"] = inputs
        return _speculative_entry(original, owner, speculation=speculation, **kwargs)

    model.generate = generate
    model._adaspec_enabled = True
    return model


TARGET_WIDTHS = arena_sizes.width_buckets(SpeculationConfig().max_speculative_tokens + 1)  # 1, 2, 3, 5, 9


def compile_steps(model, widths: tuple[int, ...] = (1,)) -> Any:
    """On a GPU, record ``model``'s forwards over these widths (new tokens per row) after ``torch.compile``,
    which fuses the element-wise kernels a decoding step is made of; for a draft model width 1 is its drafted
    token, for a target the widths its arenas record (``TARGET_WIDTHS``: a plain step and the padded
    verification widths at the default ``max_speculative_tokens``). Only where its cache is an arena
    (``kv_cache="auto"`` on a GPU, or "static"). On a GPU each width is recorded both ways and the compiled
    recording is kept only where its replay measures faster (``static_kv.keep_compiled``). The first request
    compiles each width (tens of seconds, once per process and arena size); cost tables and profiles key on
    the compiled widths. ``widths=()`` undoes it. Returns the model.

    Raises:
        ValueError: a width that is not an integer in 1..65.
    """
    if any(isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= 65 for w in widths):
        raise ValueError(f"widths must be integers in 1..65 (new tokens of a forward), got {widths!r}")
    arenas_of(model).compile(frozenset(widths))  # recordings made without it are made again
    return model
