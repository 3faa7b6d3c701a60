"""The 4-bit weight formats built for a GPU's small batches of rows: their conversions and what each needs.

Design: speculative decoding's forwards on a GPU carry 1 to k + 1 tokens per row, where a 4-bit format must keep
a quarter of bf16's bytes at every one of those widths (bitsandbytes' NF4 does at 1 row only). Three candidates,
each applied to a dense model after loading, are timed against NF4 and dense weights by ``quantization="auto"``
(``format_choice``) and by the GPU check; what measures no faster is deleted there:

- ``int4``: torch's own int4 kernel (tinygemm, ``aten._weight_int4pack_mm``) called directly by
  ``kernels.int4.Int4Linear``: groups of 128, no padding, nothing to install.
- ``int4-torchao``: the same kernel through torchao's ``Int4WeightOnlyConfig`` (``tile_packed_to_4d``), the
  well-kept wrapper (``pip install torchao``); it pads the input features to a multiple of 1024.
- ``gemlite``: gemlite's Triton kernels for 1 to 64 rows of activations (a GEMV below 5 rows, split-K GEMMs
  above), 4-bit HQQ weights in groups of 128, through torchao's ``UIntxWeightOnlyConfig``
  (``pip install torchao gemlite``; Triton ships with CUDA builds of torch).

Each format's ``missing(device)`` is None where it can run, else one line naming the missing kernel or library
(``formats.fallback`` loads NF4 instead, saying so). Layers whose shape a kernel does not take stay dense, and the
output head stays dense unless ``quantize_lm_head``. Nothing is imported from torchao or gemlite before a
conversion or a check asks for it (gemlite queries the GPU at import).
"""

from __future__ import annotations

import importlib.util

import torch

from ..kernels import int4

TORCHAO_GROUP = 128  # input features per scale and zero in torchao's formats


def _linears(model: torch.nn.Module, quantize_lm_head: bool, fits) -> dict[str, torch.nn.Linear]:
    """The model's linear layers (by qualified name) that ``fits`` takes; the output head only with
    ``quantize_lm_head``."""
    head = model.get_output_embeddings()
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and fits(m) and (quantize_lm_head or m is not head)
    }


def convert_int4(model: torch.nn.Module, quantize_lm_head: bool) -> None:
    """Every linear layer ``kernels.int4.fits`` (the output head only with ``quantize_lm_head``) to
    ``kernels.int4.Int4Linear``, in place, on the layer's device."""
    chosen = set(_linears(model, quantize_lm_head, int4.fits).values())
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if child in chosen:
                setattr(module, name, int4.Int4Linear(child))


def _ao_fits(layer: torch.nn.Linear) -> bool:
    return layer.in_features % TORCHAO_GROUP == 0 and layer.out_features % 8 == 0


def _quantize_with_torchao(model: torch.nn.Module, quantize_lm_head: bool, config) -> None:
    """torchao's ``quantize_`` with ``config`` on the layers ``_ao_fits`` takes (the head as ``_linears``)."""
    from torchao.quantization import quantize_

    chosen = {id(m) for m in _linears(model, quantize_lm_head, _ao_fits).values()}
    quantize_(model, config, filter_fn=lambda module, fqn: id(module) in chosen)


def convert_int4_torchao(model: torch.nn.Module, quantize_lm_head: bool) -> None:
    """torchao's int4 weight-only format (tinygemm's layout, groups of ``TORCHAO_GROUP``), in place."""
    from torchao.quantization import Int4WeightOnlyConfig

    config = Int4WeightOnlyConfig(
        group_size=TORCHAO_GROUP, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
    )
    _quantize_with_torchao(model, quantize_lm_head, config)


def convert_gemlite(model: torch.nn.Module, quantize_lm_head: bool) -> None:
    """gemlite's 4-bit format (HQQ weights, groups of ``TORCHAO_GROUP``) through torchao, in place."""
    from torchao.prototype.quantization.quant_api import UIntxWeightOnlyConfig

    config = UIntxWeightOnlyConfig(group_size=TORCHAO_GROUP, bit_width=4, set_inductor_config=False)
    _quantize_with_torchao(model, quantize_lm_head, config)


def _cuda(device: str, kernel: str) -> str | None:
    """None on a CUDA device torch sees; else the line saying ``kernel`` needs one."""
    if torch.device(device).type != "cuda":
        return f"{kernel}: CUDA only, not {torch.device(device).type}"
    if not torch.cuda.is_available():
        return f"{kernel}: needs a CUDA device, and torch sees none"
    return None


def _installed(*packages: str) -> str | None:
    """None when every package imports here; else the line naming the missing ones and the pip command."""
    absent = [p for p in packages if importlib.util.find_spec(p) is None]
    return f"{', '.join(absent)} not installed (pip install {' '.join(absent)})" if absent else None


def missing_int4(device: str) -> str | None:
    """``int4``: torch's kernel on a CUDA device of compute capability 8.0 or later."""
    return _cuda(device, "torch's int4 kernel") or int4.missing(device)


def missing_int4_torchao(device: str) -> str | None:
    """``int4-torchao``: torchao, and torch's kernel as for ``int4``."""
    return missing_int4(device) or _installed("torchao")


def missing_gemlite(device: str) -> str | None:
    """``gemlite``: a CUDA device, torchao, gemlite and Triton."""
    return _cuda(device, "gemlite's Triton kernels") or _installed("torchao", "gemlite", "triton")
