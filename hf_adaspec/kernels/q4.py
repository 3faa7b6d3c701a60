"""4-bit weights, 8-bit activations: a linear layer whose matmul is our AVX2 kernel (``q4.c``).

Design (issue 44): on a CPU without AVX512-BF16 bitsandbytes' NF4 dequantizes every weight before multiplying
and torch's int4 kernel (``_weight_int4pack_mm_for_cpu``) unpacks in float, so a 1-token forward of a 1.5B
model is bound by arithmetic, not by memory. llama.cpp's answer is integer dot products of 4-bit weights with
activations quantized to 8 bits per group of 32 (Q4_1 x Q8_1), which keeps a matrix-vector product near the
memory's speed. ``q4.c`` does the same for torch tensors: ``pack`` quantizes a weight [N, K] to min–max 4 bits
per group of 32 (fp16 scale and minimum; K padded with zero groups to a multiple of 256); ``linear`` quantizes
the activations [M, K] (float32 or bfloat16, read in place) per group of 32 to int8 (round to nearest, scale
max|x| / 127), multiplies, 4 activation rows per pass over a weight row, weight rows split over torch's threads,
adds the bias and writes the activations' dtype — one foreign call per layer, no tensor operations around it.

The C source is compiled on first use with the machine's C compiler (``$CC``, else ``cc``) into
``<directory>/q4-<hash>.so`` (written atomically) and loaded with ``ctypes``; it shares torch's OpenMP runtime.
On a CPU without AVX2, FMA and F16C (or not x86-64) the same arithmetic runs in plain C, slowly: ``auto`` then
times it out of the choice. Nothing is built or loaded at import. ``KernelUnavailable`` says why the kernel
cannot be built here (no compiler, a failed build), naming the fix.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import secrets
import shutil
import subprocess
from pathlib import Path

import torch

GROUP = 32  # input features per scale/minimum
BLOCK = 256  # input features per block (8 groups); K is padded to a multiple
_SOURCE = Path(__file__).with_name("q4.c")
_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11")
_P, _I = ctypes.c_void_p, ctypes.c_int64


class KernelUnavailable(RuntimeError):
    """The q4 kernel cannot be built or run on this machine; the message names the fix."""


def _compiler() -> str:
    """``$CC`` if set, else ``cc`` or ``gcc``: its path. Raises KernelUnavailable when there is none."""
    wanted = os.environ.get("CC")
    cc = shutil.which(wanted) if wanted else (shutil.which("cc") or shutil.which("gcc"))
    if not cc:
        what = f"$CC={wanted}" if wanted else "no C compiler"
        raise KernelUnavailable(f"the q4 kernel is compiled on first use and {what} was not found: install one "
                                "(Debian/Ubuntu: apt install gcc) or set $CC to it")
    return cc


@functools.cache
def source_tag() -> str:
    """16 hex digits of the SHA-256 of ``q4.c``: which kernel a cached q4 cost or format choice was measured with."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]


def build(directory: Path) -> Path:
    """The kernel's shared library in ``directory``, compiled now unless a build of this source and these flags is
    there. Raises KernelUnavailable: no C compiler, or the compiler failed (its message)."""
    cc = _compiler()
    tag = hashlib.sha256(_SOURCE.read_bytes() + " ".join((cc, *_FLAGS)).encode()).hexdigest()[:16]
    path = Path(directory) / f"q4-{tag}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")  # files.sweep's pattern
    done = subprocess.run([cc, *_FLAGS, str(_SOURCE), "-o", str(tmp), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelUnavailable(f"{cc} could not build the q4 kernel: {done.stderr.strip()[-400:]}")
    os.replace(tmp, path)
    return path


@functools.lru_cache(maxsize=None)
def library(directory: Path) -> ctypes.CDLL:
    """The loaded kernel (built in ``directory`` if needed); ``q4_avx2()`` says whether ``q4_linear`` takes the
    AVX2 path on this CPU. Raises KernelUnavailable as ``build``."""
    torch.get_num_threads()  # torch (and its OpenMP runtime, which the kernel then shares) is loaded first
    lib = ctypes.CDLL(str(build(directory)))
    _C = ctypes.c_int
    lib.q4_linear.argtypes = [_P, _P, _C, _I, _I, _I, _I, _P, _P, _C, _C, _C]
    if (lib.q4_wblock_bytes(), lib.q4_xblock_bytes()) != (160, 320):
        raise KernelUnavailable("the q4 kernel was built with an unexpected struct layout; report this")
    return lib


def padded(k: int) -> int:
    """``k`` input features rounded up to a whole block (``BLOCK``)."""
    return -(-k // BLOCK) * BLOCK


def pack(weight: torch.Tensor) -> torch.Tensor:
    """Weight [N, K] (K a multiple of ``GROUP``; any float dtype) → blocks uint8 [N, padded(K) / 256, 160]:
    min–max 4-bit codes per group of 32 with fp16 scale and minimum (``q4.c``'s ``wblock``).
    Raises ValueError when K is not a multiple of ``GROUP``."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"q4 packs weights whose input features are a multiple of {GROUP}, not {k}")
    w = torch.nn.functional.pad(weight.detach().float(), (0, padded(k) - k)).view(n, -1, 8, GROUP)  # [N, B, 8, 32]
    lo, hi = w.amin(-1), w.amax(-1)  # [N, B, 8]
    scale = ((hi - lo) / 15).half()
    minimum = lo.half()
    inv = torch.where(scale.float() > 0, 1 / scale.float(), torch.zeros_like(lo))
    q = ((w - minimum.float()[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    q = q.view(n, -1, 8, 2, 4, 4).permute(0, 1, 3, 4, 2, 5)  # [N, B, half, p, group, 4]: element 16 half + 4p + e
    codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, -1, 128)  # [N, B, 128]: low nibble half 0, high half 1
    return torch.cat([codes, scale.view(torch.uint8), minimum.view(torch.uint8)], -1).contiguous()  # [N, B, 160]


def unpack(blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The float32 weight [N, k] that ``blocks`` (``pack``'s output) encode."""
    n, nb, _ = blocks.shape
    codes = blocks[..., :128].reshape(n, nb, 1, 4, 8, 4)  # [N, B, 1, p, group, 4]
    halves = torch.cat([codes & 15, codes >> 4], dim=2)  # [N, B, half, p, group, 4]
    q = halves.permute(0, 1, 4, 2, 3, 5).reshape(n, nb, 8, GROUP).float()  # [N, B, 8, 32]
    scale = blocks[..., 128:144].contiguous().view(torch.float16).float()  # [N, B, 8]
    minimum = blocks[..., 144:160].contiguous().view(torch.float16).float()
    return (q * scale[..., None] + minimum[..., None]).reshape(n, -1)[:, :k]


_NATIVE = (torch.float32, torch.bfloat16)  # activation dtypes the kernel reads and writes in place


def linear(x: torch.Tensor, blocks: torch.Tensor, n: int, directory: Path, bias: torch.Tensor | None = None,
           portable: bool = False) -> torch.Tensor:
    """x [M, K'] (float32 or bfloat16 read as they are, other float dtypes via float32; K' ≤ the blocks' padded K,
    the rest taken as zeros) @ W.T (+ bias [N], read as float32) → [M, N] in x's dtype (float32 for other dtypes), with W
    packed as ``blocks`` [N, K/256, 160]; ``portable`` runs the plain-C path whatever the CPU. Raises
    KernelUnavailable as ``library``; ValueError for tensors off the CPU (the kernel reads host memory) or a K'
    wider than the blocks; MemoryError when the activations' scratch buffer cannot be allocated."""
    if x.device.type != "cpu" or blocks.device.type != "cpu":
        raise ValueError(f"the q4 kernel runs on the CPU; got x on {x.device} and weights on {blocks.device}: "
                         "keep a q4 model on the CPU, or load another quantization for this device")
    lib = library(directory)  # a Path: its hash is cached, so this lookup is cheap on every call
    m, k_in, k = x.shape[0], x.shape[1], blocks.shape[1] * BLOCK
    if k_in > k:
        raise ValueError(f"x has {k_in} input features but the packed weight holds {k}")
    if x.dtype not in _NATIVE:
        x = x.float()
    x = x.contiguous()  # [M, K']
    y = torch.empty(m, n, dtype=x.dtype)  # [M, N]
    if m == 0:
        return y
    if bias is not None and bias.dtype != torch.float32:  # a model cast after conversion casts the buffer too
        bias = bias.float()
    bf16 = x.dtype == torch.bfloat16
    if lib.q4_linear(blocks.data_ptr(), x.data_ptr(), bf16, m, k_in, n, k, None if bias is None else bias.data_ptr(),
                     y.data_ptr(), bf16, portable, torch.get_num_threads()):
        raise MemoryError(f"the q4 kernel could not allocate {m} x {k} activations' scratch")
    return y


class Q4Linear(torch.nn.Module):
    """``nn.Linear`` for inference with 4-bit weights (``pack``) and 8-bit activations: y = x W^T + b computed by
    ``linear``, returned in x's dtype. Input [..., in_features], output [..., out_features]. CPU only."""

    def __init__(self, linear: torch.nn.Linear, directory: Path):
        super().__init__()
        self.in_features, self.out_features, self.directory = linear.in_features, linear.out_features, Path(directory)
        self.register_buffer("blocks", pack(linear.weight))  # [N, K/256, 160]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x.reshape(-1, self.in_features), self.blocks, self.out_features, self.directory, self.bias)
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)  # [..., N]; .to copies only for other dtypes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
