"""Plain ``generate`` through the flat forward: a q4 model's own ``forward`` made to run its decoding steps as
``flat_forward`` does (the logits a speculative request's steps give, to the bit), and everything else as
transformers' forward.

Design: ``hf_adaspec.load`` makes a q4 model's attention the packed, lean one, so that plain ``generate`` runs
what a speculative request's steps run. Its steps still go through transformers' forward, module by module;
``use_flat_forward`` gives the model (the instance, not its class) a ``forward`` that hands a decoding step to
``flat_forward`` where the call is one it runs — the inputs transformers' ``generate`` passes for a step over a
cache without holes (input ids, an all-ones attention mask or none, positions that follow the cache) and no
outputs beyond the logits — and calls the class's ``forward`` otherwise (a prompt, padding, labels, embeddings,
attentions or hidden states asked for). The empty cache ``generate`` makes for a model with full attention only
is given growing layers first (``cache_layers.grow_empty_cache``): the steps then append to it in place, and the
flat forward runs its decoder stack as a speculative request's steps do. Its signature is the class's
(``__wrapped__``), which ``generate`` inspects. A copy of the model (``copy.deepcopy``) binds the copy.
"""

from __future__ import annotations

import functools
import types

import torch
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .cache_layers import grow_empty_cache
from .flat_forward import FLAT_MODELS, flat_forward
from .lean_attention import qualified_name
from .model_calls import PACKED_SDPA

_FALSY_OPTIONS = frozenset({"output_attentions", "output_hidden_states", "cache_position", "return_dict"})


def _positions_follow(held: int, n: int, attention_mask, position_ids, cache_position) -> bool:
    """Whether the step's mask, positions and cache positions are those of a cache without holes."""
    follow = torch.arange(held, held + n)
    if attention_mask is not None and (attention_mask.shape[-1] != held + n or not bool(attention_mask.all())):
        return False
    if position_ids is not None and not torch.equal(position_ids.cpu(), follow.expand_as(position_ids)):
        return False
    return cache_position is None or torch.equal(cache_position.cpu(), follow)


def _step(model: torch.nn.Module, input_ids, attention_mask, position_ids, past_key_values, logits_to_keep, options):
    """The flat forward's output for a decoding step it runs, else None."""
    if input_ids is None or not isinstance(past_key_values, Cache) or not isinstance(logits_to_keep, int):
        return None
    if set(options) - _FALSY_OPTIONS or any(options.get(k) for k in ("output_attentions", "output_hidden_states")):
        return None
    if model.config._attn_implementation != PACKED_SDPA or options.get("return_dict") is False:
        return None
    n, held = input_ids.shape[1], past_key_values.get_seq_length()
    if not _positions_follow(held, n, attention_mask, position_ids, options.get("cache_position")):
        return None
    out = flat_forward(model, input_ids, past_key_values, min(logits_to_keep, n) or n)
    return None if out is None else CausalLMOutputWithPast(logits=out[0], past_key_values=past_key_values)


def _forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    if inputs_embeds is None and labels is None and use_cache is not False:
        grow_empty_cache(self, past_key_values)
        out = _step(self, input_ids, attention_mask, position_ids, past_key_values, logits_to_keep, kwargs)
        if out is not None:
            return out
    return type(self).forward(
        self,
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        labels=labels,
        use_cache=use_cache,
        logits_to_keep=logits_to_keep,
        **kwargs,
    )


def use_flat_forward(model: torch.nn.Module) -> bool:
    """Give ``model`` (a class of ``FLAT_MODELS``) the forward that runs decoding steps flat (module docstring), in
    place; idempotent. False (nothing changed) for a model of another class."""
    if qualified_name(model) not in FLAT_MODELS:
        return False
    own = model.__dict__.get("forward")
    if not (isinstance(own, types.MethodType) and own.__func__.__code__ is _forward.__code__):
        model.forward = types.MethodType(functools.wraps(type(model).forward)(_forward_for()), model)
    return True


def _forward_for():
    """A fresh function object for ``functools.wraps`` to label (the module's ``_forward`` stays unlabelled)."""
    return types.FunctionType(_forward.__code__, _forward.__globals__, "forward", _forward.__defaults__)
