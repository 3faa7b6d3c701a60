"""A stack of q4 decoder layers of the Llama formula over a few new tokens as one foreign call (``decoder.c``).

Design: once a q4 model's matrix products stream at the memory's speed, a decoding step on a CPU is paced by what
runs between them: per layer two norms, the rotary split, the attention, two residual sums, four kernel calls, and
the Python and torch dispatch around each (``backend.hf_compat.flat_forward``'s loop), each of them finding its code
and data evicted by the weights streamed since. ``DecoderStack`` makes the stack one call: ``decoder.c`` calls the
same C functions in the same order as the loop (q4.c's products, layer_ops.c's norm, rotary split, attention and
sum), so its values are the loop's to the bit, and only the order of calls moves into C. The stack binds every
layer's weights once (pointers into the layers' buffers) and checks, at every call, that each layer still holds what
it bound (a replaced buffer, a cast or a dense route is seen: ``ready`` says no, and the caller runs the loop).
Nothing is built or loaded at import.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cbuild, q4
from . import layer_ops as ops
from .fused import GatedMLP
from .layer_ops import RMSNorm
from .q4_layer import Q4Linear

_SOURCE = Path(__file__).with_name("decoder.c")
_I, _P, _F = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Ops(ctypes.Structure):
    _fields_ = [(name, _P) for name in ("linear", "swiglu", "norm", "rope", "attention", "add")]


class _Matrix(ctypes.Structure):
    _fields_ = [("w", _P), ("kinds", _P), ("rows", _P), ("segments", _I), ("k_in", _I), ("k", _I), ("out", _I)]
    _fields_ += [("bias", _P), ("isa", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", _P), ("norm2", _P), ("eps1", _F), ("eps2", _F), ("scale", _F)]
    _fields_ += [(name, _Matrix) for name in ("qkv", "o", "gate_up", "down")]


class _Cache(ctypes.Structure):
    _fields_ = [("k", _P), ("v", _P), ("columns", _I)]


class _Block(ctypes.Structure):
    _fields_ = [("x", _P), ("cos", _P), ("sin", _P), ("scratch", _P)]
    _fields_ += [(name, _I) for name in ("b", "n", "hidden", "heads", "kv_heads", "d", "held", "cos_stride")]
    _fields_ += [("bf16", _I), ("threads", _I)]


@functools.cache
def _library(directory: Path) -> tuple[ctypes.CDLL, _Ops]:
    """The stack's library and the operations it calls (each library built in ``directory`` if needed).
    Raises KernelUnavailable as ``cbuild.build``."""
    q, layer_ops = q4.library(directory), ops.library(directory)
    lib = ctypes.CDLL(str(cbuild.build(_SOURCE, directory)))
    lib.decoder_layers.argtypes = [_P, _P, _P, _I, _P]
    functions = (q.q4_linear, q.q4_swiglu, layer_ops.ops_rms_norm, layer_ops.ops_rope_split)
    functions += (layer_ops.ops_attention, layer_ops.ops_add)
    return lib, _Ops(*(ctypes.cast(f, _P).value for f in functions))


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer's parts, as the stack calls them: x += o(attention(rope(qkv(norm1(x))))), then
    x += down(swiglu(gate_up(norm2(x)))) with the MLP's gate_up and down_proj as it holds them at each call;
    ``scale`` multiplies the attention's dot products (1/√D)."""

    norm1: RMSNorm
    qkv: Q4Linear  # the fused query/key/value projection: H query heads, H_kv key heads, H_kv value heads
    o: Q4Linear
    norm2: RMSNorm
    mlp: GatedMLP  # its gate_up: I gate rows, then I up rows
    scale: float

    def matrices(self) -> tuple[tuple[Q4Linear, str], ...] | None:
        """The four products and the kernel function of each, or None where the MLP is not a SwiGLU of q4 layers
        now (the loop then runs the layer)."""
        mlp = self.mlp._modules
        down = mlp["down_proj"]
        if not (self.mlp.silu and isinstance(down, Q4Linear)):
            return None
        return (self.qkv, "q4_linear"), (self.o, "q4_linear"), (mlp["gate_up"], "q4_swiglu"), (down, "q4_linear")

    def fits(self, hidden: int, heads: int, kv_heads: int, d: int) -> bool:
        """Whether the widths chain: hidden → qkv ((H + 2·H_kv)·D) → H·D → hidden → 2·I → I → hidden, with D a
        multiple of 16 (``layer_ops.attention``'s C path)."""
        matrices = self.matrices()
        if matrices is None:
            return False
        (qkv, _), (o, _), (gate_up, _), (down, _) = matrices
        return (
            self.norm1.weight.shape == self.norm2.weight.shape == (hidden,)
            and qkv.in_features == hidden
            and qkv.out_features == (heads + 2 * kv_heads) * d
            and o.in_features == heads * d
            and o.out_features == hidden == gate_up.in_features == down.out_features
            and gate_up.out_features == 2 * down.in_features
            and d % 16 == 0
            and kv_heads > 0
            and heads % kv_heads == 0
        )


class DecoderStack:
    """``layers`` in order over x [B, n, hidden], in place (module docstring), each layer's new keys and values
    written into its cache's buffers. ``heads``, ``kv_heads``
    and ``head_dim`` (D) are the attention's. Raises ValueError for layers whose widths do not chain
    (``StackLayer.fits``); KernelUnavailable where a library cannot be built."""

    def __init__(self, layers: list[StackLayer], heads: int, kv_heads: int, head_dim: int, directory: Path):
        self.layers, self.heads, self.kv_heads, self.head_dim = tuple(layers), heads, kv_heads, head_dim
        self.directory = Path(directory)
        self.hidden = layers[0].norm1.weight.shape[0] if layers else 0
        if not all(layer.fits(self.hidden, heads, kv_heads, head_dim) for layer in layers):
            raise ValueError(
                f"a layer's widths do not make a decoder layer of {self.hidden} features and {heads} + 2·{kv_heads} "
                f"heads of {head_dim}"
            )
        self._per_row = (3 * heads + 2 * kv_heads) * head_dim + 2 * self.hidden  # qkv, queries, attended, normed, ...
        self._gated = 0  # the widest SwiGLU output of the bound layers (the scratch's last part)
        self._lib, self._ops = _library(self.directory)
        self._bound: tuple | None = None  # (what the layers held when bound, the ctypes layers)

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickling) loads its library again and binds its own layers' buffers."""
        return {**self.__dict__, "_lib": None, "_ops": None, "_bound": None}

    def _held(self, rows: int) -> tuple | None:
        """What the layers hold now: each matrix's bound kernel arguments and each norm's weight (identities), or
        None where a layer is not one the stack runs for ``rows`` activation rows: its MLP changed, a matrix without
        a bound call (``Q4Linear.kernel_arguments``) or on its dense route."""
        held = []
        for layer in self.layers:
            matrices = layer.matrices()
            if matrices is None or not layer.fits(self.hidden, self.heads, self.kv_heads, self.head_dim):
                return None
            for m, function in matrices:
                if m.dense_rows is not None and rows >= m.dense_rows:
                    return None
                arguments = m.kernel_arguments(function)
                if arguments is None:
                    return None
                held.append(arguments)
            held += (layer.norm1.weight, layer.norm2.weight)
        return tuple(held)

    def ready(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether ``run`` takes x [B, n, hidden] with cos and sin [B or 1, n, D]: one dtype the C code reads, on the
        CPU, every norm's weight of that dtype, every matrix on its kernel for B·n rows (not its dense route), and
        every layer's buffers bound (bound again here when one was replaced)."""
        b, n, hidden = x.shape
        if not (x.dtype in ops.NATIVE and x.is_cpu and cos.dtype == sin.dtype == x.dtype and x.is_contiguous()):
            return False
        if hidden != self.hidden or cos.shape != sin.shape or cos.shape[0] not in (1, b):
            return False
        if cos.shape[1:] != (n, self.head_dim) or not (cos.is_cpu and sin.is_cpu):
            return False
        for layer in self.layers:
            if any(w.dtype != x.dtype or not w.is_contiguous() for w in (layer.norm1.weight, layer.norm2.weight)):
                return False
        held = self._held(b * n)
        if held is None:
            return False
        if self._bound is None or any(a is not b for a, b in zip(held, self._bound[0], strict=True)):
            if self._lib is None:
                self._lib, self._ops = _library(self.directory)
            self._bound = (held, (_Layer * len(self.layers))(*(self._bind(layer) for layer in self.layers)))
            self._gated = max(layer.mlp.down_proj.in_features for layer in self.layers)
        return True

    def _bind(self, layer: StackLayer) -> _Layer:
        matrices = []
        for m, function in layer.matrices():  # not None: ``_held`` saw them
            w, kinds, rows, segments, k_in, k, bias, isa = m.kernel_arguments(function)
            matrices.append(_Matrix(w, kinds, rows, segments, k_in, k, m.out_features, bias, isa))
        norms = (layer.norm1.weight.data_ptr(), layer.norm2.weight.data_ptr(), layer.norm1.eps, layer.norm2.eps)
        return _Layer(*norms, layer.scale, *matrices)

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[tuple[torch.Tensor, torch.Tensor]],
        held: int,
    ) -> None:
        """Every layer over x [B, n, hidden] (``ready`` said yes), in place: layer i attends over the first held
        columns of caches[i] = (keys, values) [B, H_kv, C, D] (contiguous, in x's dtype, C ≥ held + n) and the
        block's, which it writes at columns held … held + n − 1. cos and sin [B or 1, n, D].
        Raises ValueError for caches that do not fit; RuntimeError where an operation fails (its code)."""
        b, n, hidden = x.shape
        d = self.head_dim
        if len(caches) != len(self.layers) or any(not self._fits(k, v, x, held + n) for k, v in caches):
            raise ValueError(f"the stack needs {len(self.layers)} caches [{b}, {self.kv_heads}, ≥ {held + n}, {d}]")
        cos, sin = cos.contiguous(), sin.contiguous()
        scratch = torch.empty(b * n * (self._per_row + self._gated), dtype=x.dtype)  # one layer's intermediate values
        block = _Block(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), scratch.data_ptr(), b, n, hidden, self.heads)
        block.kv_heads, block.d, block.held, block.cos_stride = (
            self.kv_heads,
            d,
            held,
            0 if cos.shape[0] == 1 else n * d,
        )
        block.bf16, block.threads = x.dtype == torch.bfloat16, torch.get_num_threads()
        tables = (_Cache * len(caches))(*((k.data_ptr(), v.data_ptr(), k.shape[2]) for k, v in caches))
        functions, layers = ctypes.byref(self._ops), self._bound[1]
        if rc := self._lib.decoder_layers(functions, layers, tables, len(caches), ctypes.byref(block)):
            raise RuntimeError(f"decoder.c stopped with code {rc} (-1 or 2: out of memory)")

    def _fits(self, keys: torch.Tensor, values: torch.Tensor, x: torch.Tensor, columns: int) -> bool:
        return (
            keys.shape[:2] == (x.shape[0], self.kv_heads)
            and keys.shape[2] >= columns
            and keys.shape[3] == self.head_dim
            and values.shape == keys.shape
            and keys.dtype == values.dtype == x.dtype
            and keys.is_contiguous()
            and values.is_contiguous()
        )
