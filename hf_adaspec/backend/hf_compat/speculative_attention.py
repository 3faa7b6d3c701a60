"""The attention a speculative request runs with, swapped in for the request and out after it.

Speculation runs a model's "sdpa" attention as ``use_packed_attention``'s (the same SDPA computation, its
grouped-query heads packed on a CPU) and a q4 model's attention modules as ``use_lean_attention``'s (the same
values, the rotary embedding in one C call). Both are faster on the engine's narrow forwards, and neither is
what a user who loaded a model with transformers loaded: plain ``generate`` on such an enabled model runs
transformers' own. (``hf_adaspec.load`` makes them a q4 model's own at load: then a swap changes nothing.)

``AttentionSwap`` is one model's swap. Its first ``swap_in`` makes the switch through transformers
(``set_attn_implementation``, a walk over the modules) and notes what changed: each config whose attention
implementation moved, each attention module replaced. Later swaps write those attributes back and forth, with
no walk: about 10 µs a model, where the walks cost about 0.15 ms on the 2-layer test model (and grow with the
layers). A noted change is checked before it is replayed; where the model changed under it (its
implementation set anew, a module replaced), the swap notes again.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .lean_attention import LeanAttention, use_lean_attention
from .model_calls import use_packed_attention


@dataclass(frozen=True)
class _Config:
    config: object  # a transformers config (a model's or a sub-config)
    own: object  # its attention implementation outside speculation
    speculative: object  # during it


@dataclass(frozen=True)
class _Module:
    parent: torch.nn.Module
    name: str
    own: torch.nn.Module  # transformers' attention module
    lean: LeanAttention  # the module that replaces it during speculation


def _configs(model: torch.nn.Module) -> list[object]:
    """Every config whose attention implementation ``set_attn_implementation`` may write: those of the model and
    its transformers submodels, and their sub-configs, each once."""
    found: dict[int, object] = {}
    pending = [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while pending:
        config = pending.pop()
        if id(config) not in found:
            found[id(config)] = config
            pending.extend(sub for key in config.sub_configs if (sub := getattr(config, key)) is not None)
    return list(found.values())


class AttentionSwap:
    """One model's swap between its own attention and speculation's (module docstring). Holds the model weakly.
    Not for two requests at once: the caller holds the model for the request (``arenas.ModelArenas.hold``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)
        self._configs: tuple[_Config, ...] | None = None  # None: not noted yet, or stale
        self._modules: tuple[_Module, ...] = ()
        self._swapped = False

    def _current(self) -> bool:
        """Whether what was noted still holds outside speculation: each config's implementation and module."""
        return (
            self._configs is not None
            and all(c.config._attn_implementation_internal == c.own for c in self._configs)
            and all(m.parent.get_submodule(m.name) is m.own for m in self._modules)
        )

    def swap_in(self) -> None:
        """Switch to speculation's attention (no-op while already switched)."""
        if self._swapped:
            return
        model = self._model()
        if self._current():
            for c in self._configs:
                c.config._attn_implementation_internal = c.speculative
            for m in self._modules:
                m.parent.register_module(m.name, m.lean)
        else:
            configs = _configs(model)
            own = [c._attn_implementation_internal for c in configs]
            lean_before = {id(m) for m in model.modules() if isinstance(m, LeanAttention)}
            use_packed_attention(model)
            use_lean_attention(model)
            self._configs = tuple(
                _Config(c, before, c._attn_implementation_internal)  # the model's own always
                for c, before in zip(configs, own, strict=True)
                if c is model.config or c._attn_implementation_internal != before
            )
            self._modules = tuple(
                _Module(parent, name, child.inner, child)
                for parent in model.modules()
                for name, child in parent.named_children()
                if isinstance(child, LeanAttention) and id(child) not in lean_before
            )
        self._swapped = True

    def swap_out(self) -> None:
        """Back to the model's own attention (no-op while not switched). Modules that were already lean before
        the first ``swap_in`` (``use_lean_attention`` called by hand) stay lean."""
        if not self._swapped:
            return
        for m in self._modules:
            m.parent.register_module(m.name, m.own)
        for c in self._configs or ():
            c.config._attn_implementation_internal = c.own
        self._swapped = False


@contextlib.contextmanager
def speculative_attention(*swaps: AttentionSwap) -> Iterator[None]:
    """Within the block each swap's model runs speculation's attention; after it (also when the block raises)
    its own again."""
    done = []
    try:
        for swap in swaps:
            swap.swap_in()
            done.append(swap)
        yield
    finally:
        for swap in reversed(done):
            swap.swap_out()
