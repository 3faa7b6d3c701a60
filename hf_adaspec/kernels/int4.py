"""4-bit weights on torch's own int4 kernel: a linear layer whose matmul is ``aten._weight_int4pack_mm``.

Design: on a GPU a decoding step reads every weight once, for 1 token or for the k + 1 of a verification, so a
4-bit weight should cost a quarter of bf16's bytes at any of those widths. bitsandbytes' NF4 does not: its
matrix-vector kernel serves one row only, and from 2 rows on it dequantizes every weight to bf16 before the
matmul, so a verification costs twice a step. torch ships the tinygemm kernel (``_weight_int4pack_mm``, CUDA,
sm80 and later), built for a few rows of activations against 4-bit weights on tensor cores; this layer calls it
directly. torchao's ``Int4WeightOnlyConfig`` (packing format ``tile_packed_to_4d``) wraps the same kernel but
pads the input features to a multiple of 1024 (the 7B's 3584 to 4096) and pads the activations at every call;
it is timed beside this layer as ``int4-torchao`` (``models.cuda_formats``).

The numerics are tinygemm's: per group of ``GROUP`` input features, min–max asymmetric 4 bits,
q = round((w − min) / s) ∈ 0 … 15 with s = (max − min) / 15, dequantized as (q − 8) · s + z where the zero
z = min + 8 · s; scales and zeros are bf16, ``[K / GROUP, N, 2]``. Packing: two 4-bit values per byte (the
even column in the high nibble) in ``[N, K / 2]`` uint8, then ``_convert_weight_to_int4pack`` lays them out in
tiles (``[N / 8, K / (16 · INNER_K_TILES), 32, INNER_K_TILES / 2]`` int32). On a CPU the same layer runs torch's
CPU variant (``_weight_int4pack_mm_for_cpu``, its own packing): that is how the tests check the numerics against
``dequantize``; it is no contender there (it unpacks in float, ``kernels.q4``). Activations are bf16 (the
kernel's only dtype); the output returns in the input's dtype.
"""

from __future__ import annotations

import torch

GROUP = 128  # input features per scale and zero
INNER_K_TILES = 8  # tinygemm's tiles along K: K must be a multiple of 16 · INNER_K_TILES
N_TILE = 8  # output features per tile on CUDA


def fits(layer: torch.nn.Linear) -> bool:
    """Whether ``layer``'s shape suits the kernel: input features a multiple of ``GROUP`` and of
    16 · ``INNER_K_TILES``, output features a multiple of ``N_TILE``."""
    return layer.in_features % max(GROUP, 16 * INNER_K_TILES) == 0 and layer.out_features % N_TILE == 0


def missing(device: str) -> str | None:
    """None where the kernel runs on ``device``; else one line naming what is missing. CUDA needs compute
    capability 8.0 or later (tinygemm's tensor-core kernel)."""
    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            return "torch's int4 kernel (_weight_int4pack_mm) needs a CUDA device; torch sees none"
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        if major < 8:
            return (
                f"torch's int4 kernel (_weight_int4pack_mm) needs compute capability 8.0 or later; "
                f"this GPU has {major}.{minor}"
            )
        return None
    if kind == "cpu":
        return None
    return f"torch's int4 kernel runs on CUDA and the CPU, not {kind}"


def quantize(weight: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (any float dtype) → (q [N, K] int32 in 0 … 15, scales and zeros [K / group, N, 2] bf16), min–max
    per group of ``group`` input features (tinygemm's convention, module docstring). Raises ValueError: K not a
    multiple of ``group``."""
    n, k = weight.shape
    if k % group:
        raise ValueError(f"input features {k} are not a multiple of the group size {group}")
    w = weight.float().reshape(n, k // group, group)  # [N, G, group]
    low, high = w.amin(-1), w.amax(-1)  # [N, G]
    scale = ((high - low) / 15).clamp(min=1e-6)
    zero = low + 8 * scale
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    s, z = (scales_and_zeros[..., i].float().t()[..., None] for i in (0, 1))  # [N, G, 1]: the values stored
    q = ((w - (z - 8 * s)) / s).round().clamp(0, 15)  # [N, G, group]
    return q.reshape(n, k).to(torch.int32), scales_and_zeros


def dequantize(q: torch.Tensor, scales_and_zeros: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The float32 weight [N, K] that q [N, K] and scales and zeros [K / group, N, 2] stand for: (q − 8) · s + z."""
    n, k = q.shape
    s, z = (scales_and_zeros[..., i].float().t()[..., None] for i in (0, 1))  # [N, G, 1]
    return ((q.float().reshape(n, k // group, group) - 8) * s + z).reshape(n, k)


def pack(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """q [N, K] int32 (0 … 15) in the kernel's layout for ``device``: tiles on CUDA, ``[N, K / 2]`` uint8 on a CPU."""
    if device.type == "cuda":
        nibbles = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).to(device)  # [N, K / 2]
        return torch.ops.aten._convert_weight_to_int4pack(nibbles.contiguous(), INNER_K_TILES)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(device), INNER_K_TILES)


class Int4Linear(torch.nn.Module):
    """A linear layer with 4-bit weights on torch's int4 kernel, made from ``layer`` (``fits`` must hold) on its
    device; x [..., K] → [..., N] in x's dtype (computed in bf16), plus the bias."""

    def __init__(self, layer: torch.nn.Linear, group: int = GROUP) -> None:
        super().__init__()
        if not fits(layer):
            raise ValueError(
                f"Int4Linear needs in_features a multiple of {max(GROUP, 16 * INNER_K_TILES)} and "
                f"out_features a multiple of {N_TILE}; got {layer.in_features} → {layer.out_features}"
            )
        self.in_features, self.out_features, self.group = layer.in_features, layer.out_features, group
        device = layer.weight.device
        with torch.no_grad():
            q, scales_and_zeros = quantize(layer.weight, group)
            self.register_buffer("packed", pack(q, device))
            self.register_buffer("scales_and_zeros", scales_and_zeros.to(device))
            bias = None if layer.bias is None else layer.bias.detach().clone()
        self.register_buffer("bias", bias)
        self._mm = (
            torch.ops.aten._weight_int4pack_mm if device.type == "cuda" else torch.ops.aten._weight_int4pack_mm_for_cpu
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, K]
        y = self._mm(rows, self.packed, self.group, self.scales_and_zeros)  # [M, N] bf16
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group={self.group}"
