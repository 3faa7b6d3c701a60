"""A q4 model's forward over a few new tokens on the engine's cache as one flat loop over its decoder layers, or its
decoder stack as one C call: the same operations as transformers' forward on the same modules but for the
attention's kernel, so the logits are transformers' within its rounding and each row's bits are its own.

Design: once a q4 model's matrix products stream at the memory's speed, its 1-token forward on a CPU is paced by
what runs around them, and transformers' forward of a decoder layer is a stack of module calls (the layer, two
norms, the attention, its projections, the MLP, each through ``nn.Module.__call__``), mask and position code, and
output records, per layer and per step. ``flat_forward`` runs the model's forward as its formula, for the models
whose forward is the Llama formula (``FLAT_MODELS``, each compared with transformers' in the tests):

    x = embed(ids); (cos, sin) = rotary(x, positions)
    per layer: x = x + o_proj(attention(rope(qkv(norm₁(x))), cache)); x = x + mlp(norm₂(x))
    logits = head(norm(x)[:, -keep:])

with the q4 model's lean parts (``models.lean_layer``: C norms, a gated MLP of one kernel call;
``kernels.layer_ops.RopeSplit``: the fused query/key/value output split and rotated in one call) and the C attention
of the block's rows over the cache (``kernels.layer_ops.attention``: each row alone, so a verification's rows are
the steps' rows to the bit, and greedy speculative decoding is plain greedy decoding). Where every layer is one it
runs (SwiGLU, q4 projections, heads of a multiple of 16) and the cache is the engine's, the layers run as the plan's
``kernels.decoder.DecoderStack``: one C call for the whole stack, the same C functions in the same order, so the
same bits as the loop, which runs otherwise (transformers' cache layers, feature layers asked for, a dense route),
calling each module's ``forward`` directly (hooks on the layers' modules are not run). It runs only where that is
what transformers would compute; anywhere else it returns None and the caller runs the model:
- the model: a class of ``FLAT_MODELS``, in eval mode, without hooks, every decoder layer lean (norms
  ``RMSNorm``, the MLP ``GatedMLP``, the attention of a class in ``lean_attention.ATTENTIONS`` over one fused q4
  projection, no window), full attention in every layer; its attention implementation the packed one (the caller,
  ``model_calls.forward``, checks that);
- the cache: ``GrowingLayer``s without windows (``new_cache``) or transformers' ``DynamicLayer``s (plain
  ``generate``, ``use_flat_forward``); no holes (no mask, positions follow the cache);
- the block: 1 … ``FLAT_ROWS`` new tokens over a cache that holds columns (a prompt on an empty cache takes
  transformers' causal path), feature layers below the layer count.
The new keys and values are written into the cache's buffers by the call that splits and rotates them
(``RopeSplit.into_cache`` over ``GrowingLayer.open_columns``): no copies.
The plan (each layer's modules, the stack) is built once per model and checked at every call against the model's
modules, so a replaced module (a swap of the attention for its ``LeanAttention``, a user's change) is seen.
"""

from __future__ import annotations

import types
import weakref
from dataclasses import dataclass

import torch
from torch.nn.modules import module as nn_module
from transformers.cache_utils import DynamicLayer

from ...kernels import layer_ops
from ...kernels.decoder import DecoderStack, StackLayer
from ...kernels.fused import GatedMLP
from ...kernels.layer_ops import RMSNorm, RopeSplit
from ...kernels.q4_layer import Q4Linear
from ...models.lean_layer import qualified_name
from .cache_layers import GrowingLayer
from .lean_attention import ATTENTIONS, LeanAttention, fused_qkv
from .model_facts import layer_types

FLAT_ROWS = 16  # the most new tokens a flat forward takes (steps and verifications; prompts run the model)
FLAT_MODELS = frozenset(  # forward: the Llama formula (module docstring), decoder layers as in FLAT_LAYERS
    {
        "transformers.models.llama.modeling_llama.LlamaForCausalLM",
        "transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM",
    }
)
FLAT_LAYERS = frozenset(  # forward: x + attention(norm₁(x)), then x + mlp(norm₂(x))
    {
        "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
        "transformers.models.qwen2.modeling_qwen2.Qwen2DecoderLayer",
    }
)


@dataclass(frozen=True)
class _Layer:
    decoder: torch.nn.Module
    norm1: RMSNorm
    attention: torch.nn.Module  # transformers' module (swapped for its LeanAttention during speculation)
    qkv: Q4Linear  # the fused query/key/value projection
    split: RopeSplit
    o_proj: torch.nn.Module
    norm2: RMSNorm
    mlp: GatedMLP

    def same_modules(self, decoder: torch.nn.Module) -> bool:
        """Whether ``decoder`` is this layer's and still holds these modules (its attention, or the
        ``LeanAttention`` around it)."""
        m = decoder._modules
        attention = m["self_attn"]
        return (
            decoder is self.decoder
            and m["input_layernorm"] is self.norm1
            and m["post_attention_layernorm"] is self.norm2
            and m["mlp"] is self.mlp
            and (
                attention is self.attention or (type(attention) is LeanAttention and attention.inner is self.attention)
            )
        )

    def hooked(self) -> bool:
        """Whether a module whose ``forward`` the flat loop calls directly, or that it skips, has a hook."""
        m = self.decoder._modules
        return any(
            _hooks(x)
            for x in (self.decoder, m["self_attn"], self.norm1, self.qkv, self.o_proj, self.norm2, self.mlp)
            + (self.mlp.down_proj,)
        )

    def stacked(self) -> StackLayer | None:
        """This layer as ``DecoderStack`` runs it (where its output projection is a q4 layer), else None."""
        if not isinstance(self.o_proj, Q4Linear):
            return None
        return StackLayer(self.norm1, self.qkv, self.o_proj, self.norm2, self.mlp, float(self.attention.scaling))


@dataclass(frozen=True)
class _Plan:
    base: torch.nn.Module  # the decoder stack (``model.model``)
    layers: tuple[_Layer, ...]
    stack: DecoderStack | None  # the layers as one C call, where every layer is one it runs

    def same_modules(self, model: torch.nn.Module) -> bool:
        decoders = self.base._modules["layers"]
        return (
            model._modules["model"] is self.base
            and len(decoders) == len(self.layers)
            and all(layer.same_modules(d) for layer, d in zip(self.layers, decoders))
        )

    def hooked(self) -> bool:
        return any(layer.hooked() for layer in self.layers)


_PLANS: weakref.WeakKeyDictionary[torch.nn.Module, _Plan | None] = weakref.WeakKeyDictionary()


def _layer(decoder: torch.nn.Module) -> _Layer | None:
    """``decoder``'s modules where it is a lean layer of ``FLAT_LAYERS`` (module docstring), else None."""
    m = decoder._modules
    attention = m.get("self_attn")
    if type(attention) is LeanAttention:
        attention = attention.inner
    kind = qualified_name(attention) if attention is not None else ""
    if (
        qualified_name(decoder) not in FLAT_LAYERS
        or kind not in ATTENTIONS
        or ATTENTIONS[kind](attention).get("sliding_window") is not None
        or not fused_qkv(attention)
        or not isinstance(m.get("input_layernorm"), RMSNorm)
        or not isinstance(m.get("post_attention_layernorm"), RMSNorm)
        or not isinstance(m.get("mlp"), GatedMLP)
    ):
        return None
    qkv = attention.q_proj.layer
    heads, kv_heads = (
        attention.q_proj.out_features // attention.head_dim,
        attention.k_proj.out_features // attention.head_dim,
    )
    split = RopeSplit(heads, kv_heads, qkv.directory)
    return _Layer(
        decoder, m["input_layernorm"], attention, qkv, split, attention.o_proj, m["post_attention_layernorm"], m["mlp"]
    )


def _new_plan(model: torch.nn.Module) -> _Plan | None:
    if qualified_name(model) not in FLAT_MODELS or any(set(layer_types(model)) - {"full_attention"}):
        return None
    base = model._modules["model"]
    decoders = base._modules["layers"]
    if len(decoders) != model.config.num_hidden_layers:
        return None
    layers = tuple(_layer(d) for d in decoders)
    if any(layer is None for layer in layers):
        return None
    stacked = [layer.stacked() for layer in layers]
    split, d = layers[0].split, layers[0].attention.head_dim
    fits = all(
        s is not None and s.fits(stacked[0].norm1.weight.shape[0], split.heads, split.kv_heads, d) for s in stacked
    )
    stack = DecoderStack(stacked, split.heads, split.kv_heads, d, layers[0].qkv.directory) if fits else None
    return _Plan(base, layers, stack)


def _plan(model: torch.nn.Module) -> _Plan | None:
    """``model``'s plan where it holds its modules, none of them hooked; None where it has none (or they are
    hooked now). A plan whose modules were replaced since is built again."""
    plan = _PLANS.get(model, False)
    if plan is False or (plan is not None and not plan.same_modules(model)):
        plan = _PLANS[model] = _new_plan(model)
    return plan if plan is not None and not plan.hooked() else None


_CAPTURE_HOOK = ("transformers.utils.output_capturing", "install_output_capuring_hook.<locals>.output_capturing_hook")


def _hooks(module: torch.nn.Module) -> bool:
    """Whether ``module`` has forward hooks (its ``__call__`` would run them; a direct ``forward`` does not) other
    than transformers' output-capturing hooks, which it installs for good on a model's first forward that
    records outputs and which record nothing outside such a forward."""
    forward_hooks, pre_hooks = module._forward_hooks, module._forward_pre_hooks
    if not forward_hooks and not pre_hooks:  # most modules: checked at every step, so first
        return False
    hooks = (*forward_hooks.values(), *pre_hooks.values())
    return not all(isinstance(h, types.FunctionType) and (h.__module__, h.__qualname__) == _CAPTURE_HOOK for h in hooks)


def _hooked(model: torch.nn.Module) -> bool:
    """Forward hooks on the model itself or on every module (a flat forward would not run them)."""
    return _hooks(model) or bool(nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)


def flat_forward(
    model: torch.nn.Module, input_ids: torch.Tensor, cache, keep: int, feature_layers: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """transformers' forward of ``model`` over input_ids [B, n] (on the model's device) appended to ``cache``,
    without holes, as one flat loop (module docstring) → (logits of the last ``keep`` columns [B, keep, V] and,
    with ``feature_layers``, the residual stream at the inputs of those layers [B, n, len(layers)·H], both in the
    model's dtype), or None where the model, the cache or the block is not one it runs (nothing was run then).
    The caller checks that the packed attention is the model's implementation."""
    b, n = input_ids.shape
    if not 1 <= n <= FLAT_ROWS or not 1 <= keep <= n or not input_ids.is_cpu or model.training or _hooked(model):
        return None
    plan = _plan(model)
    layers = cache.layers
    if plan is None or len(layers) != len(plan.layers) or any(not 0 <= f < len(layers) for f in feature_layers):
        return None
    if any(type(layer) is not DynamicLayer and (type(layer) is not GrowingLayer or layer.window) for layer in layers):
        return None
    held = layers[0].get_seq_length()
    if held == 0:  # a prompt: transformers' causal path, and the cache's buffers are made by its first update
        return None
    base = plan.base
    x = base.embed_tokens(input_ids)  # [B, n, H]
    positions = torch.arange(held, held + n, device=x.device).unsqueeze(0)  # [1, n]
    cos, sin = base.rotary_emb(x, positions)  # [1, n, D] each
    features: dict[int, torch.Tensor] = {}  # layer → the residual stream at its input, [B, n, H]
    stack = plan.stack
    if stack is not None and not feature_layers and all(type(layer) is GrowingLayer for layer in layers):
        if stack.ready(x, cos, sin):
            opened = [layer.open_columns(n) for layer in layers]  # (keys, values [B, H_kv, C, D], first column)
            if any(first != held for _, _, first in opened):
                raise ValueError("the cache's layers hold different numbers of columns")
            stack.run(x, cos, sin, [(keys, values) for keys, values, _ in opened], held)  # x updated in place
            return model.lm_head(base.norm(x[:, -keep:])), None  # [B, keep, V]
    x = _layer_loop(plan, layers, x, cos, sin, feature_layers, features)
    logits = model.lm_head(base.norm(x[:, -keep:]))  # [B, keep, V]
    return logits, torch.cat([features[i] for i in feature_layers], dim=-1) if feature_layers else None


def _layer_loop(plan: _Plan, layers: list, x: torch.Tensor, cos, sin, feature_layers, features: dict) -> torch.Tensor:
    """The decoder layers over x [B, n, H] one module call at a time (``DecoderStack``'s calls, from Python) → the
    residual stream after the last; ``features`` filled with the stream at the inputs of ``feature_layers``."""
    b, n, _ = x.shape
    for i, (layer, cached) in enumerate(zip(plan.layers, layers)):
        if i in feature_layers:
            features[i] = x
        qkv = layer.qkv.forward(layer.norm1.forward(x))  # [B, n, (H + 2·H_kv)·D]
        if type(cached) is GrowingLayer:
            keys, values, first = cached.open_columns(n)  # [B, H_kv, C, D] each
            q = layer.split.into_cache(qkv, cos, sin, keys, values, first)  # [B, H, n, D]; keys, values cached
        else:  # transformers' layer: it copies the columns in
            q, k, v = layer.split(qkv, cos, sin)
            keys, values = cached.update(k, v)  # [B, H_kv, L + n, D]
            first = keys.shape[2] - n
        attended = layer_ops.attention(q, keys, values, first, layer.attention.scaling, layer.qkv.directory)
        x = x + layer.o_proj.forward(attended.reshape(b, n, -1))  # attended [B, n, H, D]
        x = x + layer.mlp.forward(layer.norm2.forward(x))
    return x
