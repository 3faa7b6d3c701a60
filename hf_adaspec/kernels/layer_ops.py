"""The small operations of a decoder layer around its matrix products, in C (``layer_ops.c``): RMSNorm, the
rotary position embedding applied while a fused query/key/value output is split into heads, the causal attention
of a block of new tokens over a cache, and the residual sum.

Design: once its matrix products stream at the memory's speed, a q4 model's 1-token forward on a CPU is
paced by what runs outside them: tensor operations of microseconds each and the Python around them. transformers'
RMSNorm is seven of them per call, twice per layer, and its rotary embedding fourteen (a profile of the q4
1.5B's 1-token step: 13.5 of 60 ms outside the kernel). ``RMSNorm`` computes the
Llama family's formula in one foreign call with the same rounding (``layer_ops.c``); ``rope_split`` splits a fused
query/key/value output into heads and rotates the queries and keys in one call, to the bit as transformers does;
``attention`` computes each query row alone, so a verification's rows are the steps' rows to the bit (torch's SDPA
is the faster kernel in isolation, but a decoding step on a CPU pays more for its dispatch and cold caches than for
its arithmetic). ``kernels.decoder`` calls these functions from C.
The library is built on first use like the q4 kernel (``cbuild``) and shares torch's OpenMP runtime. Nothing is
built or loaded at import.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import torch

from . import cbuild

_SOURCE = Path(__file__).with_name("layer_ops.c")
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
NATIVE = (torch.float32, torch.bfloat16)  # dtypes the C code reads and writes
_WIDEST = 65536  # the widest row layer_ops.c takes (its stack copy)


@functools.cache
def library(directory: Path) -> ctypes.CDLL:
    """The loaded library (built in ``directory`` if needed). Raises KernelUnavailable as ``cbuild.build``."""
    torch.get_num_threads()  # torch (and its OpenMP runtime, which the library then shares) is loaded first
    lib = ctypes.CDLL(str(cbuild.build(_SOURCE, directory)))
    lib.ops_rms_norm.argtypes = [_P, _P, _I, _I, ctypes.c_float, _P, _C, _C]
    lib.ops_rope_split.argtypes = [_P, _P, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _I, _I, _C]
    lib.ops_attention.argtypes = [_P, _P, _P, _I, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P, _C, _C]
    lib.ops_add.argtypes = [_P, _P, _I, _C]
    lib.ops_add.restype = None
    return lib


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama-family RMSNorm (Zhang & Sennrich 2019, eq. 4): weight · (x / √(mean(x²) + eps)), the
    mean and scaling in float32, the normalized x rounded to x's dtype before the product. x [..., H], weight
    [H] → [..., H] in the promoted dtype of weight and x."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(torch.nn.Module):
    """A drop-in for the Llama family's RMSNorm module (``rms_norm_reference``'s values; the sum of squares in
    another order, so a last bit can differ) holding the same ``weight`` [H] parameter. Input [..., H] → output
    [..., H]. x and weight of one dtype, float32 or bfloat16, on the CPU: one C call (``layer_ops.c``, its function
    looked up once per module); any other combination: ``rms_norm_reference``. Raises KernelUnavailable at
    construction where the library cannot be built (``cbuild``)."""

    def __init__(self, weight: torch.nn.Parameter, eps: float, directory: Path):
        super().__init__()
        self.weight, self.eps, self.directory = weight, float(eps), Path(directory)
        self._norm = library(self.directory).ops_rms_norm  # fails here, before the model's own module is replaced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.shape[-1]
        w = self._parameters["weight"]
        if not (x.is_cpu and w.is_cpu and x.dtype == w.dtype and x.dtype in NATIVE and h == w.shape[0] <= _WIDEST):
            return rms_norm_reference(x, w, self.eps)
        x, w = x.contiguous(), w.contiguous()
        y = torch.empty_like(x)  # [..., H]
        norm = self._norm
        if norm is None:
            norm = self._norm = library(self.directory).ops_rms_norm
        bf16 = x.dtype == torch.bfloat16
        if norm(x.data_ptr(), w.data_ptr(), x.numel() // h, h, self.eps, y.data_ptr(), bf16, torch.get_num_threads()):
            raise ValueError(f"layer_ops.c refused a row of {h} features")
        return y

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickling) looks its function up again: a ctypes function is not copied."""
        return {**super().__getstate__(), "_norm": None}

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary position embedding (Su et al. 2021, RoFormer, eq. 34, rotate-half layout):
    x · cos + rotate_half(x) · sin with rotate_half(x) = (−x[..., D/2:], x[..., :D/2]). x [B, H, n, D], cos and
    sin [B or 1, n, D] → [B, H, n, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def rope_split(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int, directory: Path
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused projection's output qkv [B, n, (H + 2·H_kv)·D] (the H query heads, then the H_kv key heads, then the
    H_kv value heads) → q [B, H, n, D] and k [B, H_kv, n, D] rotated (``rotate_half_reference``'s values to the
    bit: each product and the sum rounded to the dtype) and v [B, H_kv, n, D], each contiguous. cos and sin
    [B or 1, n, D]. qkv, cos and sin of one dtype, float32 or bfloat16, on the CPU: one C call (``layer_ops.c``);
    otherwise torch's operations. Raises ValueError when qkv's width is not (H + 2·H_kv) times an even D.
    Raises KernelUnavailable as ``library``."""
    return RopeSplit(heads, kv_heads, directory)(qkv, cos, sin)


class RopeSplit:
    """``rope_split`` for ``heads`` query and ``kv_heads`` key/value heads, its C function looked up on the first
    call only: (qkv, cos, sin) → (q, k, v) as ``rope_split``, which raises as it does."""

    def __init__(self, heads: int, kv_heads: int, directory: Path):
        self.heads, self.kv_heads, self.directory = heads, kv_heads, Path(directory)
        self._split: Callable[..., int] | None = None

    def __getstate__(self) -> dict:
        """A copy (``copy.deepcopy``, pickling) looks its function up again: a ctypes function is not copied."""
        return {**self.__dict__, "_split": None}

    def __call__(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, _ = qkv.shape
        d = self._head_width(qkv)
        if not self._native(qkv, cos, sin, qkv.dtype):
            q, k, v = self._reference(qkv, cos, sin, d)
            return rotate_half_reference(q, cos, sin), rotate_half_reference(k, cos, sin), v
        k = torch.empty(b, self.kv_heads, n, d, dtype=qkv.dtype)  # [B, H_kv, n, D]
        v = torch.empty(b, self.kv_heads, n, d, dtype=qkv.dtype)  # [B, H_kv, n, D]
        return self._split_into(qkv, cos, sin, k, v, 0), k, v

    def into_cache(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        first: int,
    ) -> torch.Tensor:
        """``__call__``'s split with the keys and values written into a cache's buffers keys and values
        [B, H_kv, C, D] (contiguous) at columns first … first + n − 1, in their dtype (as a cache's update writes
        them) → q [B, H, n, D]. Raises ValueError as ``__call__``, and where the columns do not fit."""
        b, n, _ = qkv.shape
        d = self._head_width(qkv)
        if first < 0 or first + n > keys.shape[2] or not (keys.is_contiguous() and values.is_contiguous()):
            raise ValueError(f"columns {first} … {first + n - 1} of {tuple(keys.shape)} cannot take the new keys")
        if not (self._native(qkv, cos, sin, keys.dtype) and values.dtype == keys.dtype):
            q, k, v = self._reference(qkv, cos, sin, d)
            keys[:, :, first : first + n] = rotate_half_reference(k, cos, sin)
            values[:, :, first : first + n] = v
            return rotate_half_reference(q, cos, sin)
        return self._split_into(qkv, cos, sin, keys, values, first)

    def _head_width(self, qkv: torch.Tensor) -> int:
        d, rest = divmod(qkv.shape[-1], self.heads + 2 * self.kv_heads)
        if rest or d % 2:
            raise ValueError(
                f"a fused query/key/value output {qkv.shape[-1]} wide is not {self.heads} + 2·{self.kv_heads} "
                "heads of an even width"
            )
        return d

    def _native(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_dtype: torch.dtype) -> bool:
        """Whether the C call takes these: one dtype it reads (keys and values written in it too), the CPU,
        cos and sin [B or 1, n, D]."""
        b, n, _ = qkv.shape
        return (
            qkv.dtype in NATIVE
            and cos.dtype == sin.dtype == kv_dtype == qkv.dtype
            and qkv.is_cpu
            and cos.is_cpu
            and sin.is_cpu
            and cos.shape == sin.shape
            and cos.shape[0] in (1, b)
            and cos.shape[1:] == (n, qkv.shape[-1] // (self.heads + 2 * self.kv_heads))
        )

    def _reference(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, d: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, H, n, D], k and v [B, H_kv, n, D] as views of qkv, not rotated (torch's operations)."""
        b, n, _ = qkv.shape
        heads, kv_heads = self.heads, self.kv_heads
        return qkv.view(b, n, heads + 2 * kv_heads, d).transpose(1, 2).split([heads, kv_heads, kv_heads], 1)

    def _split_into(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int
    ) -> torch.Tensor:
        """The C call (``_native`` holds): q [B, H, n, D] returned, the rotated keys and the values written into
        k and v [B, H_kv, C, D] at columns first … first + n − 1."""
        b, n, _ = qkv.shape
        heads, kv_heads, dtype, d = self.heads, self.kv_heads, qkv.dtype, self._head_width(qkv)
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        q = torch.empty(b, heads, n, d, dtype=dtype)  # [B, H, n, D]
        split = self._split
        if split is None:
            split = self._split = library(self.directory).ops_rope_split
        stride = 0 if cos.shape[0] == 1 else n * d
        args = (b, n, heads, kv_heads, d, q.data_ptr(), k.data_ptr(), v.data_ptr(), k.shape[2], first)
        if split(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), stride, *args, dtype == torch.bfloat16):
            raise ValueError(f"layer_ops.c refused a head width of {d}")
        return q


def attention_reference(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, held: int, scale: float):
    """torch's scaled dot-product attention (Vaswani et al. 2017, eq. 1) of n new rows over a cache, causal without
    holes: query [B, H, n, D]; keys and values [B, H_kv, C, D] (C ≥ held + n; the first held + n columns are read;
    query head j reads key/value head j // (H / H_kv)); row i sees columns 0 … held + i → [B, n, H, D]."""
    n, groups = query.shape[2], query.shape[1] // keys.shape[1]
    k = keys[:, :, : held + n].repeat_interleave(groups, dim=1)  # [B, H, L + n, D]
    v = values[:, :, : held + n].repeat_interleave(groups, dim=1)
    mask = torch.arange(held + n) <= torch.arange(held, held + n)[:, None]  # [n, L + n]
    out = torch.nn.functional.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).contiguous()


def attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, held: int, scale: float, directory: Path
) -> torch.Tensor:
    """``attention_reference``'s attention in one C call (``layer_ops.c``: each row alone, in float32, so its bits
    do not depend on the rows beside it, and differ from torch's in the last ones): query [B, H, n, D]; keys and
    values [B, H_kv, C, D], a cache's buffers whose first held + n columns are the block's (C ≥ held + n) → [B, n,
    H, D]. Tensors of another dtype than float32 or bfloat16, mixed dtypes, off the CPU or not contiguous, and heads
    D not a multiple of 16: ``attention_reference``.
    Raises ValueError: H not a multiple of H_kv, or held + n columns beyond C. Raises KernelUnavailable as
    ``library``."""
    b, h, n, d = query.shape
    kv, columns = keys.shape[1], keys.shape[2]
    if kv <= 0 or h % kv or held < 0 or held + n > columns:
        raise ValueError(f"{h} query heads over {kv} key/value heads, {held} + {n} of {columns} columns: no attention")
    tensors = (query, keys, values)
    if d % 16 or not (
        query.dtype in NATIVE and all(t.dtype == query.dtype and t.is_cpu and t.is_contiguous() for t in tensors)
    ):
        return attention_reference(query, keys, values, held, scale)
    out = torch.empty(b, n, h, d, dtype=query.dtype)  # [B, n, H, D]
    bf16 = query.dtype == torch.bfloat16
    args = (b, n, h, kv, d, columns, held, scale, out.data_ptr(), bf16, torch.get_num_threads())
    if library(directory).ops_attention(query.data_ptr(), keys.data_ptr(), values.data_ptr(), *args):
        raise MemoryError("layer_ops.c could not allocate the attention's scratch")
    return out
