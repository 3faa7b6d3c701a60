"""``generate`` keywords and prepared generation-config fields the ``custom_generate`` path reads or drops:
EOS and pad ids, transformers' own assisted-generation options, stop strings as stopping criteria."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import StoppingCriteriaList, StopStringCriteria

# transformers' own assisted generation: GenerationConfig fields, also generate keywords (with the
# generate-only ``assistant_tokenizer``, see ``assisted_generation_options``); the custom_generate path ignores them
ASSISTED_GENERATION_OPTIONS = (
    "prompt_lookup_num_tokens",
    "max_matching_ngram_size",
    "num_assistant_tokens",
    "num_assistant_tokens_schedule",
    "assistant_confidence_threshold",
    "assistant_early_exit",
    "assistant_lookbehind",
    "target_lookbehind",
    "use_mtp",
)


def eos_token_ids(generation_config) -> tuple[int, ...]:
    """EOS ids as prepared by ``generate`` (the config's private tensor, set before our callable runs)."""
    eos = getattr(generation_config, "_eos_token_tensor", None)
    return tuple(int(t) for t in eos.flatten()) if eos is not None else ()


def pad_token_id(generation_config) -> int:
    """Pad id as prepared by ``generate`` (it falls back to EOS); 0 when neither is set."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is not None:
        return int(pad.flatten()[0])
    eos = eos_token_ids(generation_config)
    return generation_config.pad_token_id if generation_config.pad_token_id is not None else (eos[0] if eos else 0)


def assisted_generation_options(kwargs: dict[str, Any]) -> tuple[str, ...]:
    """Names of transformers' assisted-generation options a ``generate`` call sets (not None or False):
    as keywords (``assistant_tokenizer`` included), or on its ``generation_config``. The model's own
    generation config is not read (the caller did not ask for what it holds; transformers fills defaults
    such as num_assistant_tokens=20 there)."""
    config = kwargs.get("generation_config")
    names = [n for n in (*ASSISTED_GENERATION_OPTIONS, "assistant_tokenizer") if _is_set(kwargs.get(n))]
    if config is not None:
        names += [n for n in ASSISTED_GENERATION_OPTIONS if n not in names and _is_set(getattr(config, n, None))]
    return tuple(names)


def _is_set(value: Any) -> bool:
    """Whether an option's value asks for something (None and False are transformers' "unset")."""
    return value is not None and value is not False


def stop_strings_as_criteria(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``generate`` keywords with the call's stop strings moved into ``stopping_criteria``.

    transformers 5.x drops ``tokenizer`` on the ``custom_generate`` path (``_extract_generation_mode_kwargs``
    pops it, then keeps only the callable's own keywords), so ``_get_stopping_criteria`` finds stop strings
    but no tokenizer and raises. With a tokenizer, this builds the ``StopStringCriteria`` plain generate would
    (from the stop strings generate would use: keyword > ``generation_config`` > ``model.generation_config``;
    a caller's own ``StopStringCriteria`` in ``stopping_criteria`` takes precedence, as in generate) and clears
    the stop strings, so generate builds none. The caller's generation config is copied, never changed.
    Without stop strings or a tokenizer the keywords come back unchanged (generate raises its own error
    naming ``tokenizer``).
    """
    tokenizer, strings = kwargs.get("tokenizer"), _stop_strings(model, kwargs)
    if tokenizer is None or strings is None:
        return kwargs
    out, given = dict(kwargs), kwargs.get("generation_config")
    if given is not None and given.stop_strings is not None:
        out["generation_config"] = copy.deepcopy(given)
        out["generation_config"].stop_strings = None
    if "stop_strings" in kwargs or model.generation_config.stop_strings is not None:
        out["stop_strings"] = None  # a keyword overrides both configs
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or ())
    if not any(type(c) is StopStringCriteria for c in criteria):
        criteria.append(StopStringCriteria(tokenizer, strings))
    out["stopping_criteria"] = criteria
    return out


def _stop_strings(model: torch.nn.Module, kwargs: dict[str, Any]) -> str | list[str] | None:
    """The stop strings generate would use, by its priority: keyword, then given config, then the model's."""
    if "stop_strings" in kwargs:
        return kwargs["stop_strings"]
    given = kwargs.get("generation_config")
    if given is not None and given.stop_strings is not None:
        return given.stop_strings
    return model.generation_config.stop_strings
