"""A q4 model's attention made lean: one module that splits the fused query/key/value output into heads and
rotates them in one C call (``kernels.layer_ops.RopeSplit``), in place of transformers' views, transposes and
rotary operations (+2.8% tokens/s for a q4 1.5B on a Xeon, outputs identical).

Design: on a CPU a q4 model's 1-token step pays, per layer, for the rotary embedding's fourteen small tensor
operations and the three projection slices. ``LeanAttention`` replaces an attention module of a
family whose forward is known (``ATTENTIONS``, by the qualified name of its transformers class; a test compares
each with its replacement) and whose query/key/value are the three slices of one fused ``Q4Linear``
(``kernels.fused``). Everything else is transformers' own: the cache's ``update``, the attention function of
the model's implementation (``ALL_ATTENTION_FUNCTIONS``), called with the original module (the attributes it
reads: grouped heads, causality, scaling) and the same keywords as its forward passes, then ``o_proj``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...kernels.fused import Q4Slice
from ...kernels.layer_ops import RopeSplit
from ...models.lean_layer import qualified_name


def _no_keywords(attention: torch.nn.Module) -> dict:
    return {}


def _own_window(attention: torch.nn.Module) -> dict:
    return {"sliding_window": attention.sliding_window}


def _config_window(attention: torch.nn.Module) -> dict:
    return {"sliding_window": getattr(attention.config, "sliding_window", None)}


# qualified class name → the keywords its forward passes to the attention function beyond dropout and scaling
ATTENTIONS: dict[str, Callable[[torch.nn.Module], dict]] = {
    "transformers.models.llama.modeling_llama.LlamaAttention": _no_keywords,
    "transformers.models.qwen2.modeling_qwen2.Qwen2Attention": _own_window,
    "transformers.models.mistral.modeling_mistral.MistralAttention": _config_window,
}


class LeanAttention(torch.nn.Module):
    """``attention``'s forward (a class of ``ATTENTIONS``) with its fused query/key/value split and rotated in one
    call. Takes and returns what transformers' module does: hidden_states [B, n, hidden], position_embeddings
    (cos, sin) [B or 1, n, D], the mask and cache → (output [B, n, hidden], attention weights or None)."""

    def __init__(self, attention: torch.nn.Module, keywords: Callable[[torch.nn.Module], dict]):
        super().__init__()
        self.inner, self.qkv, self.o_proj = attention, attention.q_proj.layer, attention.o_proj
        self.heads = attention.q_proj.out_features // attention.head_dim
        self.kv_heads = attention.k_proj.out_features // attention.head_dim
        self.split = RopeSplit(self.heads, self.kv_heads, self.qkv.directory)
        self.keywords = keywords(attention)
        self.eager = sys.modules[type(attention).__module__].eager_attention_forward  # its forward's default
        self._settings: dict | None = None  # vars(attention.config), read on the first call
        self._attend: tuple[str | None, Callable] = (None, self.eager)  # the implementation seen last, its function
        self.train(attention.training)  # a module is made in training mode: this one follows the module it replaces

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        b, n = hidden_states.shape[:2]
        cos, sin = position_embeddings  # [B or 1, n, D]
        modules = self._modules
        inner = modules["inner"]
        q, k, v = self.split(modules["qkv"](hidden_states), cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, inner.layer_idx)  # [B, H_kv, L, D]
        out, weights = self.attention()(
            inner,
            q,
            k,
            v,
            attention_mask,
            dropout=inner.attention_dropout if self.training else 0.0,
            scaling=inner.scaling,
            **self.keywords,
            **kwargs,
        )  # out [B, n, H, D]
        return modules["o_proj"](out.reshape(b, n, -1).contiguous()), weights

    def attention(self) -> Callable:
        """The attention function of the model's implementation now (``ALL_ATTENTION_FUNCTIONS``; the module's
        eager function for "eager"), looked up again only when the implementation's name changed. The config's
        settings are read from its ``__dict__``: its attribute access costs microseconds."""
        settings = self._settings
        if settings is None:
            settings = self._settings = vars(self.inner.config)
        implementation = settings["_attn_implementation_internal"]
        seen, attend = self._attend
        if implementation != seen:
            attend = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, self.eager)
            self._attend = (implementation, attend)
        return attend

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickling) reads its own config's settings: nothing read is carried over."""
        return {**super().__getstate__(), "_settings": None, "_attend": (None, self.eager)}


def fused_qkv(attention: torch.nn.Module) -> bool:
    """``attention``'s q/k/v projections are the three slices, in order, of one fused layer that holds nothing else."""
    parts = [attention.q_proj, attention.k_proj, attention.v_proj]
    if not all(isinstance(p, Q4Slice) for p in parts) or len({id(p.layer) for p in parts}) != 1:
        return False
    bounds = [p.bounds for p in parts]
    return (
        bounds[0][0] == 0
        and bounds[0][1] == bounds[1][0]
        and bounds[1][1] == bounds[2][0]
        and bounds[2][1] == parts[0].layer.out_features
    )


def use_lean_attention(model: torch.nn.Module) -> int:
    """Replace ``model``'s attention modules of a class in ``ATTENTIONS`` whose q/k/v are one fused q4 layer by
    ``LeanAttention``, in place (idempotent: a replaced module is not replaced again); return how many were
    replaced. Raises KernelUnavailable where the C library cannot be built (at the first forward)."""
    replaced = 0
    for parent in list(model.modules()):
        if isinstance(parent, LeanAttention):
            continue
        for name, child in list(parent.named_children()):
            kind = qualified_name(child)
            if kind in ATTENTIONS and fused_qkv(child):
                setattr(parent, name, LeanAttention(child, ATTENTIONS[kind]))
                replaced += 1
    return replaced
