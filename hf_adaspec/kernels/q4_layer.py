"""``Q4Linear``: an ``nn.Linear`` whose product is the q4 kernel (``q4.linear``) on block-quantized weights.

Design: the layer holds the GGUF file's own blocks (or dense weights quantized to Q4_K) as one uint8 buffer of row
segments, one kind each, so fused projections stay one kernel call. A decoding step calls the kernel through a call
bound once to the layer's buffers (``_product``: nothing looked up or checked per step); the checked path
(``q4.linear``) serves every other case. The kernel's cost grows with the activation rows, so from ``dense_rows``
rows (set by ``kernels.route``) a long prefill takes the dense route instead: the weight dequantized in C a tile at a
time (``q4.dequantize_rows``), then torch's matmul.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from .blocks import KINDS, dequantize, padded, quantize_q4_k, row_bytes
from .q4 import NATIVE_DTYPES, dequantize_rows, isa_index, library, linear, raise_for

DENSE_TILE_BYTES = 16 << 20  # the dense route dequantizes this much weight at a time, then multiplies it


class Q4Linear(torch.nn.Module):
    """``nn.Linear`` for inference with block-quantized weights (``blocks``) and 8-bit activations: y = x W^T + b
    computed by ``linear``, returned in x's dtype. Input [..., in_features], output [..., out_features]. CPU only.
    From ``dense_rows`` activation rows on (None: never; set by ``kernels.route``) the product takes the dense
    route instead (``dense_product``: the weight dequantized, torch's matmul), which a long prompt's prefill can
    make faster.

    ``parts``: (kind, rows uint8 [N_i, blocks.row_bytes(kind, in_features)]) stacked in order (N = sum N_i): a
    matrix of one kind, or fused projections whose rows differ in kind; ``bias`` [N] or None.
    Raises ValueError for rows of another dtype or width than their kind's."""

    dense_rows: int | None = None

    def __init__(
        self, in_features: int, parts: list[tuple[str, torch.Tensor]], bias: torch.Tensor | None, directory: Path
    ):
        super().__init__()
        for kind, block_rows in parts:
            width = row_bytes(kind, in_features)
            if block_rows.dtype != torch.uint8 or block_rows.dim() != 2 or block_rows.shape[1] != width:
                raise ValueError(
                    f"{kind} rows of {in_features} features are uint8 [N, {width}], "
                    f"not {block_rows.dtype} {list(block_rows.shape)}"
                )
        self.in_features, self.directory = in_features, Path(directory)
        self.out_features = sum(int(r.shape[0]) for _, r in parts)
        self.kinds = tuple(kind for kind, _ in parts)
        flat = [r.reshape(-1) for _, r in parts]
        self.register_buffer("blocks", (flat[0] if len(flat) == 1 else torch.cat(flat)).contiguous())  # [bytes]
        self.register_buffer("kind_ids", torch.tensor([KINDS.index(k) for k in self.kinds], dtype=torch.int32))
        self.register_buffer("rows", torch.tensor([r.shape[0] for _, r in parts], dtype=torch.int64))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self._bound: dict[str, tuple] = {}  # ``_product``'s bound calls and the buffers each was bound to

    @classmethod
    def dense(cls, linear: torch.nn.Linear, directory: Path) -> Q4Linear:
        """``linear``'s weight quantized to Q4_K (``blocks.quantize_q4_k``), its bias kept.
        Raises ValueError when its input features are not a multiple of 32."""
        return cls(linear.in_features, [("q4_k", quantize_q4_k(linear.weight))], linear.bias, directory)

    def weight_float(self) -> torch.Tensor:
        """The float32 weight [N, in_features] the blocks encode."""
        parts, at = [], 0
        for kind, n in zip(self.kinds, self.rows.tolist()):
            size = n * row_bytes(kind, self.in_features)
            parts.append(dequantize(kind, self.blocks[at : at + size].view(n, -1), self.in_features))
            at += size
        return torch.cat(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._kernel(x, "q4_linear", self.out_features)
        return self._forward_checked(x) if y is None else y

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(x·Gᵀ + b_G) · (x·Uᵀ + b_U) (SwiGLU: Shazeer 2020, eq. 6) for a layer whose rows are I gate rows G
        then I up rows U, in one kernel call whose threads apply it to the values they computed (``q4.c``'s
        ``q4_swiglu``; torch's silu(g) · u on x's dtype, its sigmoid a few units in the last place from torch's).
        x [..., in_features] → [..., I] in x's dtype, or None where ``forward`` would not call the kernel (the dense
        route's row counts, weights or x off the CPU, other dtypes) or the rows are odd: the caller takes the
        product of ``forward``'s halves then."""
        return None if self.out_features % 2 else self._kernel(x, "q4_swiglu", self.out_features // 2)

    def _kernel(self, x: torch.Tensor, function: str, width: int) -> torch.Tensor | None:
        """``function`` (``q4_linear`` or ``q4_swiglu``) of x [..., in_features] → [..., width] in x's dtype, or None
        where the kernel does not take x (``forward``'s other routes)."""
        m = x.numel() // self.in_features  # activation rows
        dense = self.dense_rows is not None and m >= self.dense_rows
        if dense or not (x.is_cpu and x.dtype in NATIVE_DTYPES and m and x.shape[-1] == self.in_features):
            return None
        product = self._product(function)
        if product is None:
            return None
        x = x.contiguous()
        y = torch.empty(x.shape[:-1] + (width,), dtype=x.dtype)  # [..., width]
        bf16 = x.dtype == torch.bfloat16
        done = product(x.data_ptr(), bf16, m, y.data_ptr(), bf16, torch.get_num_threads())
        if done:
            raise_for(done, m, self.in_features, self.kind_ids, self.rows)
        return y

    def _forward_checked(self, x: torch.Tensor) -> torch.Tensor:
        """``forward`` through ``linear`` (its conversions, checks and errors) or the dense route."""
        flat = x.reshape(-1, self.in_features)  # [M, K]
        if self.dense_rows is not None and flat.shape[0] >= self.dense_rows:
            y = self.dense_product(flat)
        else:
            b = self._buffers
            y = linear(flat, b["blocks"], b["kind_ids"], b["rows"], self.in_features, self.directory, b["bias"])
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)  # [..., N]; .to copies only for other dtypes

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickling) binds its own call: the bound one points into this layer's buffers."""
        return {**super().__getstate__(), "_bound": {}}

    def _product(self, function: str = "q4_linear") -> Callable[..., int] | None:
        """``function`` (``q4_linear``, ``q4_swiglu``) with this layer's weights, bias and path bound: (x pointer, x
        is bf16, M, y pointer, y is bf16, threads) → its return code; the one call a decoding step makes per layer,
        so nothing is looked up or checked again. Bound again when a buffer was replaced (``to``, a cast); None
        where ``linear``'s checks are needed (weights off the CPU, a bias cast from float32, which ``linear`` reads
        as float32 per call)."""
        b, bound = self._buffers, self._bound.get(function)
        blocks, kinds, rows, bias = b["blocks"], b["kind_ids"], b["rows"], b["bias"]
        if bound is not None and bound[0] is blocks and bound[1] is kinds and bound[2] is rows and bound[3] is bias:
            return bound[4]
        if blocks.device.type != "cpu" or not blocks.is_contiguous():
            return None
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            return None
        lib, isa, k = library(self.directory), isa_index(self.directory, None), self.in_features
        layer = (blocks.data_ptr(), kinds.data_ptr(), rows.data_ptr(), len(kinds), k, padded(k))
        kernel = {"q4_linear": lib.q4_linear, "q4_swiglu": lib.q4_swiglu}[function]
        call = functools.partial(kernel, *layer, None if bias is None else bias.data_ptr(), isa)
        self._bound[function] = (blocks, kinds, rows, bias, call)
        return call

    def kernel_arguments(self, function: str = "q4_linear") -> tuple | None:
        """The arguments ``function``'s bound call (``_product``) starts with, for a caller that calls the kernel
        from C (``kernels.decoder``): (weights, kinds and rows pointers, segment count, K_in, K padded, bias pointer or
        None, path), the same tuple object while this layer's buffers are unchanged; None where ``_product`` has no
        bound call."""
        call = self._product(function)
        return None if call is None else call.args

    def dense_product(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in_features] @ W.T + b → [M, out_features] through dense weights: ``DENSE_TILE_BYTES`` of W at a
        time dequantized (``dequantize_rows``) into bfloat16 for bfloat16 x (float32 otherwise) and multiplied by
        torch (``F.linear``, bias rounded to that dtype: the dense model's arithmetic), in that dtype.
        Raises KernelUnavailable as ``library``."""
        dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        x = x.to(dtype)
        y = torch.empty(x.shape[0], self.out_features, dtype=dtype)  # [M, N]
        tile = max(1, DENSE_TILE_BYTES // (self.in_features * x.element_size()))
        at, first = 0, 0
        for kind, n in zip(self.kinds, self.rows.tolist()):
            width = row_bytes(kind, self.in_features)
            part = self.blocks[at : at + n * width].view(n, width)  # [n, row bytes]
            for lo in range(0, n, tile):
                w = dequantize_rows(kind, part[lo : lo + tile], self.in_features, dtype, self.directory)  # [t, K]
                cols = slice(first + lo, first + lo + w.shape[0])
                b = None if self.bias is None else self.bias[cols].to(dtype)
                y[:, cols] = torch.nn.functional.linear(x, w, b)  # [M, t]
            at, first = at + n * width, first + n
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, kinds={'+'.join(self.kinds)}, "
            f"bias={self.bias is not None}, dense_rows={self.dense_rows}"
        )
