"""Weight layouts of the q4 kernel (``q4.c``): GGUF blocks read as they are, and dense weights quantized to Q4_K.

Design: the kernel multiplies the GGUF file's own blocks, so a model loaded from a Q4_K_M file is the file's model,
not a requantization of it (the 1.5B's top-1 agreement with the dense model: 0.969, requantized 0.943). Every kind is
a superblock of 256 input features of one output row:

- ``q4_k``: GGUF Q4_K (w = d·sc·q − dmin·m per group of 32, 4-bit q, 6-bit sc and m, fp16 d and dmin) with the
  12 packed bytes of 6-bit scales unpacked to 8 + 8 bytes: 148 bytes, every bit of the file kept.
- ``q6_k``: GGUF Q6_K (w = d·sc·(q − 32) per group of 16, 6-bit q, int8 sc, fp16 d), the 16 scales as the
  even then the odd ones: 210 bytes.
- ``q8_0``: 8 GGUF Q8_0 blocks of 32 (w = d·q, int8 q, fp16 d) side by side, scales first: 272 bytes; rows whose
  width is not a multiple of 256 are padded with zero blocks.

In every kind the 256 codes of a superblock are in the kernel's order (``q4.c``): position 32j + 4l + e holds
element 4j + e of group l (``POSITION``), the 4-bit and the low 4 of the 6-bit codes as nibbles (position i < 128
the low nibble of byte i, position 128 + i its high nibble), Q6_K's high 2 bits of position 32j + b at bits
2(j // 2) of byte 32(j % 2) + b of its 64.

A row of a weight [N, K] is ``padded(K) / 256`` superblocks; a matrix's rows are a uint8 tensor [N, bytes per row].
Other GGUF block types are dequantized (``gguf.quants``) and stored as ``q8_0`` (8 bits: no bit of a 5- or 6-bit
type is dropped), dense float weights quantized to ``q4_k`` (``quantize_q4_k``: min–max per group of 32, the
group scales and minima on 6-bit grids of the superblock's d and dmin). ``dequantize`` is the float reference.
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK = 256  # input features per superblock
KINDS = ("q4_k", "q6_k", "q8_0")  # index = the kernel's kind number
BLOCK_BYTES = {"q4_k": 148, "q6_k": 210, "q8_0": 272}
# GGUF block types held without any rounding: Q4_0 and Q5_0 (d·(q − 8), d·(q − 16) per group of 32) as q8_0
GGUF_EXACT = {"Q4_K": "q4_k", "Q6_K": "q6_k", "Q8_0": "q8_0", "Q5_0": "q8_0", "Q4_0": "q8_0"}


POSITION = np.array([32 * (t // 4) + 4 * g + t % 4 for g in range(8) for t in range(32)])  # element → position


def _ordered(codes: np.ndarray) -> np.ndarray:
    """Codes [..., 256] in feature order → the kernel's order: element 32g + 4j + e (group g) to position
    32j + 4g + e (``POSITION``), a transpose of [8, 8, 4]."""
    return np.ascontiguousarray(codes.reshape(*codes.shape[:-1], 8, 8, 4).swapaxes(-3, -2)).reshape(codes.shape)


def _nibbles(codes: np.ndarray) -> np.ndarray:
    """Codes 0..15 [..., 256] in the kernel's order → bytes [..., 128]: positions i and 128 + i."""
    return (codes[..., :128] & 15) | ((codes[..., 128:] & 15) << 4)


def padded(k: int) -> int:
    """``k`` input features rounded up to whole superblocks."""
    return -(-k // BLOCK) * BLOCK


def row_bytes(kind: str, k: int) -> int:
    """Bytes of one output row of ``kind`` over ``k`` input features."""
    return padded(k) // BLOCK * BLOCK_BYTES[kind]


def quantize_q4_k(weight: torch.Tensor) -> torch.Tensor:
    """Dense weight [N, K] (K a multiple of 32, any float dtype; padded with zeros to whole superblocks) → ``q4_k``
    rows uint8 [N, row_bytes("q4_k", K)]: per group of 32 the range [min(w, 0), max(w)] on 16 levels, the
    group's step and −minimum rounded to 6-bit multiples of the superblock's largest / 63 (fp16 d, dmin).
    Raises ValueError when K is not a multiple of 32."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"q4 packs weights whose input features are a multiple of 32, not {k}")
    w = torch.nn.functional.pad(weight.detach().float(), (0, padded(k) - k)).view(n, -1, 8, 32)  # [N, B, 8, 32]
    lo = w.amin(-1).clamp(max=0)  # [N, B, 8]: Q4_K's minimum is −dmin·m, m ≥ 0
    step = (w.amax(-1) - lo) / 15
    d = (step.amax(-1) / 63).half()  # [N, B]
    dmin = (-lo.amin(-1) / 63).half()
    sc = torch.where(d[..., None] > 0, step / d.float()[..., None], 0).round().clamp(0, 63)  # [N, B, 8]
    m = torch.where(dmin[..., None] > 0, -lo / dmin.float()[..., None], 0).round().clamp(0, 63)
    scale, minimum = d.float()[..., None] * sc, dmin.float()[..., None] * m  # what the kernel will use
    inv = torch.where(scale > 0, 1 / scale, 0)
    q = ((w + minimum[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)  # [N, B, 8, 32]
    codes = torch.from_numpy(_nibbles(_ordered(q.reshape(n, -1, 256).numpy())))  # [N, B, 128]
    head = torch.cat(
        [d[..., None].view(torch.uint8), dmin[..., None].view(torch.uint8), sc.to(torch.uint8), m.to(torch.uint8)], -1
    )  # [N, B, 20]
    return torch.cat([head, codes], -1).reshape(n, -1).contiguous()


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """Dense weight [N, K] (K a multiple of 32) → ``q8_0`` rows [N, row_bytes("q8_0", K)]: per group of 32 an fp16
    scale max|w| / 127 and int8 codes rounded to nearest. Raises ValueError when K is not a multiple of 32."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"q8_0 packs weights whose input features are a multiple of 32, not {k}")
    w = torch.nn.functional.pad(weight.detach().float(), (0, padded(k) - k)).view(n, -1, 8, 32)
    d = (w.abs().amax(-1) / 127).half()  # [N, B, 8]
    inv = torch.where(d.float() > 0, 1 / d.float(), 0)
    q = (w * inv[..., None]).round().clamp(-127, 127).to(torch.int8).view(torch.uint8).reshape(n, -1, 256)
    q = torch.from_numpy(_ordered(q.numpy()))
    return torch.cat([d.view(torch.uint8).reshape(n, -1, 16), q], -1).reshape(n, -1).contiguous()


def dequantize(kind: str, rows: torch.Tensor, k: int) -> torch.Tensor:
    """The float32 weight [N, k] that ``rows`` (uint8 [N, row_bytes(kind, k)]) of ``kind`` encode."""
    n = rows.shape[0]
    b = rows.reshape(n, -1, BLOCK_BYTES[kind])  # [N, B, bytes]

    def half(lo: int, hi: int) -> torch.Tensor:
        return b[..., lo:hi].contiguous().view(torch.float16).float()

    at = torch.from_numpy(POSITION)  # feature order from the kernel's

    def nibbles(lo: int, hi: int) -> torch.Tensor:
        codes = b[..., lo:hi]
        return torch.cat([codes & 15, codes >> 4], -1)  # [N, B, 256]: positions in the kernel's order

    if kind == "q4_k":
        d, dmin = half(0, 2), half(2, 4)  # [N, B, 1]
        sc, m = b[..., 4:12].float(), b[..., 12:20].float()  # [N, B, 8]
        q = nibbles(20, 148)[..., at].reshape(n, -1, 8, 32).float()
        w = (d * sc)[..., None] * q - (dmin * m)[..., None]
    elif kind == "q6_k":
        qh = b[..., 128:192].reshape(n, -1, 1, 2, 32)
        top = (qh >> (2 * torch.arange(4, dtype=torch.uint8)).view(1, 1, 4, 1, 1)) & 3  # [N, B, i, h, 32]
        q = (nibbles(0, 128) | (top.reshape(n, -1, 256) << 4))[..., at].reshape(n, -1, 8, 2, 16).float() - 32
        sc = torch.stack([b[..., 192:200], b[..., 200:208]], -1).contiguous().view(torch.int8).float()  # [N, B, 8, 2]
        w = (half(208, 210)[..., None] * sc)[..., None] * q
    elif kind == "q8_0":
        d = half(0, 16)  # [N, B, 8]
        q = b[..., 16:].contiguous().view(torch.int8)[..., at].reshape(n, -1, 8, 32).float()
        w = d[..., None] * q
    else:
        raise ValueError(f"no layout {kind!r}; the kernel's kinds are {KINDS}")
    return w.reshape(n, -1)[:, :k]
