"""Block-quantized weights, 8-bit activations: a linear layer whose matmul is our AVX2 kernel (``q4.c``).

Design: on a CPU without AVX512-BF16 bitsandbytes' NF4 dequantizes every weight before multiplying and torch's int4
kernel unpacks in float, so a 1-token forward of a 1.5B model is bound by arithmetic, not by memory (the figures:
docs/experiments.md). llama.cpp's answer is integer dot products of its quantized blocks with activations quantized
to 8 bits (Q4_K x Q8_K), which keeps a matrix-vector product near the memory's speed. ``q4.c`` does the same for
torch tensors on the GGUF file's own blocks (``blocks``: Q4_K, Q6_K, Q8_0; dense weights quantized to Q4_K):
``linear`` quantizes the activations [M, K] (float32 or bfloat16, read in place) per 256 features to int8,
multiplies every weight superblock with up to 4 activation rows at a time, weight rows split over torch's threads,
adds the bias and writes the activations' dtype: one foreign call per layer, no tensor operations around it. A
matrix may hold rows of several kinds (segments), so fused projections stay one call. The layer around it is
``q4_layer.Q4Linear``; ``dequantize_rows`` gives the dense weights its dense route multiplies. GGUF blocks are put in
these layouts in C as well (``from_gguf``).

The C source is compiled on first use with the machine's C compiler (``$CC``, else ``cc``) into
``<directory>/q4-<hash>.so`` (written atomically) and loaded with ``ctypes``; it shares torch's OpenMP runtime.
The code path is chosen at run time from the processor's flags (``choose``, a pure function of them; the flags as
the kernel detects them, ``cpu_flags``): 512-bit vpdpbusd where the CPU has AVX512-VNNI (with AVX512F/BW/VL), else
256-bit vpdpbusd where it has AVX-VNNI (``avx_vnni``: Intel since Alder Lake, AMD since Zen 5), else AVX2 ``maddubs``,
else plain C, slowly (``auto`` then times it out of the choice). ``ATEN_CPU_CAPABILITY=avx2`` (or ``default``),
torch's own switch, caps it at AVX2 (or plain C); ``HF_ADASPEC_Q4_PATH`` names the fastest path to take instead (one
of ``PATHS``: with ``ATEN_CPU_CAPABILITY=avx2``, ``avx_vnni`` reproduces a CPU with AVX-VNNI and no AVX-512); so one
processor reproduces an older one's path; ``path`` says which runs.
The C side makes the same choice from the same flags (``q4_isa``) and never runs a path the CPU lacks. Nothing is
built or loaded at import.
``KernelUnavailable`` says why the kernel cannot be built here (no compiler, a failed build), naming the fix.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from . import cbuild
from .blocks import BLOCK_BYTES, GGUF_EXACT, KINDS, padded, row_bytes

_SOURCE = Path(__file__).with_name("q4.c")
_P, _I, _C = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
PATHS = ("portable", "avx2", "avx_vnni", "avx512_vnni")  # the kernel's code paths, q4_isa's numbering (q4.c)
FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")  # q4_cpu_flags' bits
NEEDS = {  # the flags (Linux /proc/cpuinfo's names) each path's instructions need; q4.c's NEEDS
    "portable": frozenset(),
    "avx2": frozenset(FLAGS[:3]),
    "avx_vnni": frozenset(FLAGS[:4]),
    "avx512_vnni": frozenset(FLAGS[:3] + FLAGS[4:]),
}
PATH_ENV = "HF_ADASPEC_Q4_PATH"  # names the fastest path to take
_CAPS = {"default": "portable", "avx2": "avx2"}  # ATEN_CPU_CAPABILITY values that cap the path
_XBLOCK_BYTES = 372  # q4.c's xblock: 256 codes, 16 int32 half-group sums, 8 float and 8 int16 group sums, a scale
KernelUnavailable = cbuild.KernelUnavailable


@functools.cache
def source_tag() -> str:
    """16 hex digits of the SHA-256 of ``q4.c``: which kernel a cached q4 cost or format choice was measured with."""
    return hashlib.sha256(_SOURCE.read_bytes()).hexdigest()[:16]


def build(directory: Path) -> Path:
    """The kernel's shared library in ``directory`` (``cbuild.build`` of ``q4.c``). Raises KernelUnavailable: no C
    compiler, or the compiler failed (its message)."""
    return cbuild.build(_SOURCE, directory)


@functools.cache
def library(directory: Path) -> ctypes.CDLL:
    """The loaded kernel (built in ``directory`` if needed). Raises KernelUnavailable as ``build``."""
    torch.get_num_threads()  # torch (and its OpenMP runtime, which the kernel then shares) is loaded first
    lib = ctypes.CDLL(str(build(directory)))
    lib.q4_linear.argtypes = [_P, _P, _P, _C, _I, _I, _P, _C, _P, _C, _I, _P, _C, _C]
    lib.q4_swiglu.argtypes = lib.q4_linear.argtypes
    lib.q4_dequantize.argtypes = [_C, _P, _I, _I, _I, _P, _C, _C, _C]
    lib.q4_from_gguf.argtypes = [_C, _P, _I, _I, _P, _C]
    sizes = [lib.q4_block_bytes(i) for i in range(len(KINDS))]
    if sizes != [BLOCK_BYTES[kind] for kind in KINDS] or lib.q4_block_bytes(-1) != _XBLOCK_BYTES:
        raise KernelUnavailable("the q4 kernel was built with an unexpected struct layout; report this")
    return lib


def choose(flags: Iterable[str], ceiling: str = PATHS[-1]) -> str:
    """The fastest path (one of ``PATHS``) at most ``ceiling`` whose instructions ``flags`` (names as ``FLAGS``) all
    has; the paths are not nested (a CPU may have AVX512-VNNI and not AVX-VNNI). Raises ValueError for a ``ceiling``
    not in ``PATHS``."""
    if ceiling not in PATHS:
        raise ValueError(f"no q4 kernel path {ceiling!r}: choose one of {', '.join(PATHS)}")
    have = frozenset(flags)
    return next(p for p in PATHS[PATHS.index(ceiling) :: -1] if NEEDS[p] <= have)


def cpu_flags(directory: Path) -> frozenset[str]:
    """The ``FLAGS`` this CPU has as the kernel detects them (``avx_vnni`` only where the compiler builds that path).
    Raises KernelUnavailable as ``library``."""
    bits = library(directory).q4_cpu_flags()
    return frozenset(f for i, f in enumerate(FLAGS) if bits >> i & 1)


def path(directory: Path, ceiling: str | None = None) -> str:
    """The code path (one of ``PATHS``) ``linear`` takes here: ``choose`` over this CPU's flags, at most ``ceiling``
    and at most ``$HF_ADASPEC_Q4_PATH``; where that is unset, at most what ``ATEN_CPU_CAPABILITY`` allows (``avx2``:
    AVX2; ``default``: plain C). Raises KernelUnavailable as ``library``; ValueError for a ``ceiling`` or
    ``$HF_ADASPEC_Q4_PATH`` not in ``PATHS``."""
    named = os.environ.get(PATH_ENV, "").strip().lower()
    if named and named not in PATHS:
        raise ValueError(f"{PATH_ENV}={named!r} is no q4 kernel path: choose one of {', '.join(PATHS)}")
    if ceiling is not None and ceiling not in PATHS:
        raise ValueError(f"no q4 kernel path {ceiling!r}: choose one of {', '.join(PATHS)}")
    cap = named or _CAPS.get(os.environ.get("ATEN_CPU_CAPABILITY", "").lower(), PATHS[-1])
    return choose(cpu_flags(directory), min(cap, ceiling or PATHS[-1], key=PATHS.index))


NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # activation dtypes the kernel reads and writes in place


def linear(
    x: torch.Tensor,
    blocks: torch.Tensor,
    kinds: torch.Tensor,
    rows: torch.Tensor,
    k: int,
    directory: Path,
    bias: torch.Tensor | None = None,
    ceiling: str | None = None,
    n: int | None = None,
) -> torch.Tensor:
    """x [M, K'] (float32 or bfloat16 read as they are, other float dtypes via float32; K' ≤ ``k``, the rest taken as
    zeros) @ W.T (+ bias [N], read as float32) → [M, N] in x's dtype (float32 for other dtypes). W [N, k] is held
    as segments: ``kinds`` int32 [S] (indices into ``blocks.KINDS``) of ``rows`` int64 [S] output rows each, their
    ``blocks.row_bytes`` laid one after another in ``blocks`` (uint8, contiguous). ``ceiling``: the fastest path
    (``PATHS``) to take (``path``; "portable" runs plain C whatever the CPU); ``n``: the rows' sum, where the caller
    knows it. Raises KernelUnavailable as ``library``; ValueError for tensors off the CPU (the kernel reads host
    memory), a K' wider than ``k``, an unknown ``ceiling``, or a layout the kernel refuses; MemoryError when the
    activations' scratch buffer cannot be allocated."""
    if x.device.type != "cpu" or blocks.device.type != "cpu":
        raise ValueError(
            f"the q4 kernel runs on the CPU; got x on {x.device} and weights on {blocks.device}: "
            "keep a q4 model on the CPU, or load another quantization for this device"
        )
    lib = library(directory)  # a Path: its hash is cached, so this lookup is cheap on every call
    m, k_in, n = x.shape[0], x.shape[1], int(rows.sum()) if n is None else n
    if k_in > k:
        raise ValueError(f"x has {k_in} input features but the packed weight holds {k}")
    if x.dtype not in NATIVE_DTYPES:
        x = x.float()
    x = x.contiguous()  # [M, K']
    y = torch.empty(m, n, dtype=x.dtype)  # [M, N]
    if m == 0:
        return y
    if bias is not None and bias.dtype != torch.float32:  # a model cast after conversion casts the buffer too
        bias = bias.float()
    bf16, isa = x.dtype == torch.bfloat16, isa_index(directory, ceiling)
    done = lib.q4_linear(
        blocks.data_ptr(),
        kinds.data_ptr(),
        rows.data_ptr(),
        len(kinds),
        k_in,
        padded(k),
        None if bias is None else bias.data_ptr(),
        isa,
        x.data_ptr(),
        bf16,
        m,
        y.data_ptr(),
        bf16,
        torch.get_num_threads(),
    )
    raise_for(done, m, k, kinds, rows)
    return y


def raise_for(done: int, m: int, k: int, kinds: torch.Tensor, rows: torch.Tensor) -> None:
    """q4_linear's return code as an error: -1 MemoryError (the activations' scratch), any other nonzero
    ValueError (a layout the kernel refuses); 0 returns."""
    if done == -1:
        raise MemoryError(f"the q4 kernel could not allocate {m} x {k} activations' scratch")
    if done:
        raise ValueError(f"the q4 kernel refused the layout: kinds {kinds.tolist()}, rows {rows.tolist()}")


@functools.cache
def isa_index(directory: Path, ceiling: str | None) -> int:
    """``path``'s index in ``PATHS``, the number q4_linear takes; looked up once per directory, ceiling and process
    (the environment is read at the first call)."""
    return PATHS.index(path(directory, ceiling))


def dequantize_rows(
    kind: str,
    rows: torch.Tensor,
    k: int,
    dtype: torch.dtype,
    directory: Path,
    ceiling: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight [N, k] that ``rows`` (uint8 [N, row_bytes(kind, k)]) encode, in ``dtype`` (bfloat16 rounded to
    nearest even from the float32 value; other dtypes via float32): ``blocks.dequantize``'s values, computed in
    C (8 at a time on the AVX2 and VNNI paths; ``ceiling`` as ``linear``'s, the same values on every path).
    ``out``: a contiguous [N, k] bfloat16 (for bfloat16) or float32 tensor to write them into.
    Raises KernelUnavailable as ``library``; ValueError for an unknown ``ceiling`` or an ``out`` that does not fit."""
    lib = library(directory)
    bf16 = dtype == torch.bfloat16
    want = torch.bfloat16 if bf16 else torch.float32
    if out is None:
        out = torch.empty(rows.shape[0], k, dtype=want)
    elif out.shape != (rows.shape[0], k) or out.dtype != want or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {want} [{rows.shape[0]}, {k}] tensor, not {out.dtype} {list(out.shape)}"
        )
    rows = rows.contiguous()
    lib.q4_dequantize(
        KINDS.index(kind),
        rows.data_ptr(),
        rows.shape[0],
        padded(k),
        k,
        out.data_ptr(),
        bf16,
        isa_index(directory, ceiling),
        torch.get_num_threads(),
    )
    return out.to(dtype)


_GGUF_SOURCES = {"Q4_K": (256, 144), "Q6_K": (256, 210), "Q8_0": (32, 34), "Q5_0": (32, 22), "Q4_0": (32, 18)}
# q4_from_gguf's source numbering is this order; each: (features, bytes) of a GGUF block


def from_gguf(gguf_type: str, raw: np.ndarray, k: int, directory: Path) -> tuple[str, torch.Tensor]:
    """A GGUF tensor's rows of an exact type (``blocks.GGUF_EXACT``: its name, e.g. "Q4_K") in the kernel's layout
    (``blocks``), converted in C (Q4_0 and Q5_0 to q8_0: the same values as int8 codes).

    raw: uint8 [N, bytes of a GGUF row] (``gguf.GGUFReader``'s ``tensor.data``); k: input features.
    Returns (kind, uint8 [N, blocks.row_bytes(kind, k)]). Raises ValueError for a type outside ``GGUF_EXACT`` or a
    width that does not fit its GGUF rows; KernelUnavailable as ``library``."""
    if gguf_type not in GGUF_EXACT:
        raise ValueError(f"GGUF {gguf_type} has no exact layout here; exact: {tuple(GGUF_EXACT)}")
    kind, n = GGUF_EXACT[gguf_type], raw.shape[0]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    features, size = _GGUF_SOURCES[gguf_type]
    if k % features or raw.shape[1] != k // features * size:
        raise ValueError(f"GGUF {gguf_type} rows of {raw.shape[1]} bytes do not hold {k} features")
    out = torch.empty(n, row_bytes(kind, k), dtype=torch.uint8)  # [N, bytes]
    library(directory).q4_from_gguf(
        list(_GGUF_SOURCES).index(gguf_type), raw.ctypes.data, n, k, out.data_ptr(), torch.get_num_threads()
    )
    return kind, out
