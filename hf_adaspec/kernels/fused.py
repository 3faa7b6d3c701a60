"""Sibling projections that read the same input as one kernel call: a layer's query/key/value, its gate/up.

Design (the 1.5B's 1-token forward in 0.9x the time on a 2-core AVX2 EPYC): a decoder layer calls ``q_proj(x)``,
``k_proj(x)`` and ``v_proj(x)`` one after another on the same tensor; three kernel calls quantize x three times and
pay three foreign calls and three thread fork/joins, two of them over small matrices (the key/value heads). ``fuse``
stacks the siblings' blocks into one ``Q4Linear`` (rows of several kinds stay one matrix: ``q4.c``'s segments) and
puts a ``Q4Slice`` in each sibling's place, so the model's own forward code is unchanged: the first slice called with
an input computes every sibling's output in one call, and each slice returns its columns (a view). The shared result
is kept only until every sibling has taken its columns, and is computed again for any other input (an input is
recognised by identity), so a slice called alone still gives its own product. A gated MLP whose forward is known
(``models.lean_layer``) is replaced whole by ``GatedMLP``, which calls its stacked gate/up directly: no slice modules,
no shared-result bookkeeping.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .blocks import row_bytes
from .q4_layer import Q4Linear

SILU_ACTIVATIONS = frozenset({"transformers.activations.SiLUActivation", "torch.nn.modules.activation.SiLU"})


class _Group:
    """The fused layer and the one result its slices share: (input, output, slices yet to read it)."""

    def __init__(self, layer: Q4Linear, bounds: list[tuple[int, int]]):
        self.layer, self.bounds = layer, bounds
        self._x: torch.Tensor | None = None
        self._y: torch.Tensor | None = None
        self._waiting: set[int] = set()

    def output(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Slice ``index``'s output for ``x`` [..., in_features] → [..., its out_features]."""
        if self._x is not x or index not in self._waiting:
            self._x, self._y, self._waiting = x, self.layer(x), set(range(len(self.bounds)))
        self._waiting.discard(index)
        lo, hi = self.bounds[index]
        y = self._y[..., lo:hi]
        if not self._waiting:
            self._x = self._y = None
        return y


class Q4Slice(torch.nn.Module):
    """One sibling of a fused group (``fuse``): its output columns of the group's product; the first slice holds
    the fused ``Q4Linear`` as its submodule ``fused``. Input [..., in_features], output [..., out_features]."""

    def __init__(self, group: _Group, index: int):
        super().__init__()
        self.in_features = group.layer.in_features
        lo, hi = group.bounds[index]
        self.out_features, self.index, self._group = hi - lo, index, group
        if index == 0:
            self.fused = group.layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._group.output(x, self.index)

    @property
    def layer(self) -> Q4Linear:
        """The fused ``Q4Linear`` this slice reads its columns from."""
        return self._group.layer

    @property
    def bounds(self) -> tuple[int, int]:
        """This slice's output columns [lo, hi) in ``layer``'s output."""
        return self._group.bounds[self.index]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, index={self.index}"


def stack(layers: list[Q4Linear], directory: Path) -> tuple[Q4Linear, list[tuple[int, int]]]:
    """``layers`` (same in_features) as one ``Q4Linear`` whose rows are theirs in order, and each layer's output
    columns [lo, hi) in it. Raises ValueError for layers of different input widths."""
    if len({layer.in_features for layer in layers}) != 1:
        raise ValueError("fused projections read the same input: their in_features differ")
    parts, biases, bounds, at = [], [], [], 0
    for layer in layers:
        offset = 0
        for kind, n in zip(layer.kinds, layer.rows.tolist()):
            size = n * row_bytes(kind, layer.in_features)
            parts.append((kind, layer.blocks[offset : offset + size].view(n, -1)))
            offset += size
        biases.append(layer.bias if layer.bias is not None else torch.zeros(layer.out_features))
        bounds.append((at, at + layer.out_features))
        at += layer.out_features
    bias = torch.cat(biases) if any(layer.bias is not None for layer in layers) else None
    return Q4Linear(layers[0].in_features, _merged(parts), bias, directory), bounds


def fuse(layers: list[Q4Linear], directory: Path) -> list[Q4Slice]:
    """``layers`` (same in_features) as one ``Q4Linear`` (``stack``), and one ``Q4Slice`` per layer to put in its
    place. Raises ValueError for layers of different input widths."""
    group = _Group(*stack(layers, directory))
    return [Q4Slice(group, i) for i in range(len(layers))]


class GatedMLP(torch.nn.Module):
    """A gated MLP, down(act(gate(x)) · up(x)) (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6 with the
    model's activation: SwiGLU for SiLU), with gate and up as one kernel call (``gate_up``: ``stack`` of the two)
    and no slice modules. With SiLU (``SILU_ACTIVATIONS``) the kernel applies it too (``Q4Linear.swiglu``: torch's
    values but for its sigmoid's last bits); with another activation its ``forward`` is called directly (hooks
    on ``act_fn`` are not run) and the product is taken in place of its output: the same values as the model's MLP
    module over its fused siblings. Input [..., in_features] → [..., down_proj.out_features]."""

    def __init__(self, gate: Q4Linear, up: Q4Linear, down: torch.nn.Module, act_fn: torch.nn.Module, directory: Path):
        super().__init__()
        self.gate_up, bounds = stack([gate, up], directory)
        self.intermediate = bounds[0][1]
        self.down_proj, self.act_fn = down, act_fn
        self.silu = f"{type(act_fn).__module__}.{type(act_fn).__qualname__}" in SILU_ACTIVATIONS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modules, i = self._modules, self.intermediate
        if self.silu and (y := modules["gate_up"].swiglu(x)) is not None:  # [..., I]: one kernel call
            return modules["down_proj"](y)  # [..., H]
        y = modules["gate_up"](x)  # [..., 2·I]: gate's columns, then up's
        return modules["down_proj"](modules["act_fn"].forward(y[..., :i]).mul_(y[..., i:]))  # [..., H]


def _merged(parts: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Adjacent parts of one kind as one part (fewer segments for the kernel)."""
    out: list[tuple[str, torch.Tensor]] = []
    for kind, rows in parts:
        if out and out[-1][0] == kind:
            out[-1] = (kind, torch.cat([out[-1][1], rows]))
        else:
            out.append((kind, rows))
    return out
