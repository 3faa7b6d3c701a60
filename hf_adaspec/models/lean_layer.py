"""A q4 model's decoder layers made lean: the modules around the kernel calls replaced, where transformers'
forward is a known formula, by modules that compute the same values in fewer operations (a SiLU-gated MLP's
sigmoid aside: its last bits are the kernel's).

Design: a 1-token forward of a q4 model on a CPU spends a large share of its time outside the kernel, in tensor
operations of microseconds each and the Python around them. Two modules are replaced, by the qualified name of
their transformers class (the families listed below, each compared with its replacement in the tests):
- an RMSNorm of the Llama formula → ``kernels.layer_ops.RMSNorm`` (one C call; same weight parameter);
- a gated MLP, down(act(gate(x)) · up(x)), whose gate and up are q4 layers → ``kernels.fused.GatedMLP`` (gate and
  up one kernel call, no slice modules; with SiLU the kernel's threads apply act(gate) · up to what they computed,
  ``Q4Linear.swiglu``).
Any other module, and a model of any other family, is left as it is. The attention module is made lean when the
model is enabled (``backend.hf_compat.lean_attention``: it calls transformers' attention functions).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..kernels.fused import GatedMLP
from ..kernels.layer_ops import RMSNorm
from ..kernels.q4_layer import Q4Linear


def _names(kind: str, families: tuple[tuple[str, str], ...]) -> frozenset[str]:
    return frozenset(f"transformers.models.{module}.modeling_{module}.{prefix}{kind}" for module, prefix in families)


_LLAMA_LIKE = (
    ("llama", "Llama"),
    ("qwen2", "Qwen2"),
    ("qwen3", "Qwen3"),
    ("mistral", "Mistral"),
    ("smollm3", "SmolLM3"),
)
RMS_NORMS = _names("RMSNorm", _LLAMA_LIKE)  # forward: weight · (x.float() · rsqrt(mean(x²) + eps)).to(x.dtype)
GATED_MLPS = _names("MLP", (*_LLAMA_LIKE, ("gemma", "Gemma"), ("gemma3", "Gemma3")))  # down(act(gate(x)) · up(x))


def qualified_name(module: torch.nn.Module) -> str:
    """``module``'s class as ``package.module.Class``."""
    return f"{type(module).__module__}.{type(module).__qualname__}"


def lean(model: torch.nn.Module, directory: Path) -> int:
    """Replace ``model``'s known RMSNorm modules and its known gated MLPs whose gate and up projections are both
    ``Q4Linear`` (``RMS_NORMS``, ``GATED_MLPS``), in place; return how many modules were replaced. ``directory``:
    where the kernels are built. Raises KernelUnavailable where the C library cannot be built (before any module
    is replaced)."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _replacement(child, directory)
            if new is not None:
                setattr(parent, name, new)
                replaced += 1
    return replaced


def _replacement(module: torch.nn.Module, directory: Path) -> torch.nn.Module | None:
    """The lean module for ``module``, or None where it has none."""
    kind = qualified_name(module)
    if kind in RMS_NORMS:
        return RMSNorm(module.weight, module.variance_epsilon, directory)
    if kind in GATED_MLPS and isinstance(module.gate_proj, Q4Linear) and isinstance(module.up_proj, Q4Linear):
        return GatedMLP(module.gate_proj, module.up_proj, module.down_proj, module.act_fn, directory)
    return None
