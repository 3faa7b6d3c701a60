"""Weight formats a model can be loaded in: a registry of how each is made.

Design: the fastest format depends on the processor, not on the model (issue 44): bitsandbytes' NF4 runs its
fused 4-bit kernel only where the CPU has AVX512-BF16 and dequantizes every weight before multiplying
elsewhere, while our q4 kernel (integer dot products on AVX2) and dense bf16 matmuls run on any x86-64 CPU
with AVX2. So a format is only a recipe; which one loads is decided by timing on the running machine
(``format_choice``). Each ``WeightFormat`` gives the ``quantization_config`` handed to ``from_pretrained``
(bitsandbytes) and/or a conversion applied after a dense load (``q4``: its layers replace ``nn.Linear``).

- ``nf4``: bitsandbytes 4-bit NormalFloat, blocks of 64, compute in the model's dtype.
- ``int8``: bitsandbytes LLM.int8().
- ``q4``: our kernel (``kernels/q4``): min–max 4-bit weights per group of 32 times activations quantized to
  8 bits per group of 32 (llama.cpp's Q4_1 x Q8_1), integer dot products on AVX2 (plain C elsewhere). CPU only.
- ``none``: dense weights in the requested dtype.
- ``int4``, ``int4-torchao``, ``gemlite``: 4-bit formats for a GPU's small batches of rows (``cuda_formats``).

The output head stays dense unless ``quantize_lm_head`` (a draft's head is a large share of its step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cuda_formats

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class WeightFormat:
    """How a format is made: ``config(dtype, quantize_lm_head)`` → the ``quantization_config`` for
    ``from_pretrained`` (None: a dense load), ``convert(model, quantize_lm_head)`` applied after loading
    (None: nothing), the devices it runs on (None: any), and whether ``auto`` tries it (``probed``).
    ``missing(device)``: None where its kernel runs on ``device``, else one line naming what is missing (None: it
    always runs); ``libraries``: packages whose versions key a timed choice that tried it."""

    name: str
    summary: str
    config: Callable[[torch.dtype, bool], object | None]
    convert: Callable[[torch.nn.Module, bool], None] | None = None
    devices: tuple[str, ...] | None = None
    probed: bool = True
    missing: Callable[[str], str | None] | None = None
    libraries: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.name or not self.summary:
            raise ValueError("a weight format needs a name and a summary")


def _bnb_nf4(dtype: torch.dtype, quantize_lm_head: bool):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype,
                              llm_int8_skip_modules=[] if quantize_lm_head else None)  # None: head stays dense


def _bnb_int8(dtype: torch.dtype, quantize_lm_head: bool):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=[] if quantize_lm_head else None)


def _dense(dtype: torch.dtype, quantize_lm_head: bool) -> None:
    return None


def _q4(model: torch.nn.Module, quantize_lm_head: bool) -> None:
    """Every linear layer whose input features are a multiple of 32 (the output head only with
    ``quantize_lm_head``; a tied input embedding keeps its dense table) to ``kernels.q4.Q4Linear``, whose kernel
    is built on first use under ``<cache>/kernels``. Raises KernelUnavailable (a RuntimeError) naming the fix
    where the kernel cannot be built here."""
    from ..kernels import q4
    from .assets import cache_dir

    directory = cache_dir() / "kernels"
    q4.library(directory)  # fails here, before any layer is replaced, where the kernel cannot be built
    head = model.get_output_embeddings()
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if (isinstance(child, torch.nn.Linear) and child.in_features % q4.GROUP == 0
                    and (quantize_lm_head or child is not head)):
                setattr(module, child_name, q4.Q4Linear(child, directory))


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("nf4", "bitsandbytes NF4", _bnb_nf4),
    # int8: 2.5–7x the best format's step on both CPU paths measured (docs/experiments.md); loaded when asked for
    WeightFormat("int8", "bitsandbytes LLM.int8()", _bnb_int8, probed=False),
    WeightFormat("q4", "4-bit weights x 8-bit activations on AVX2 (our kernel, groups of 32)", _dense, _q4,
                 devices=("cpu",)),
    WeightFormat("none", "dense", _dense),
)}
FORMATS.update({f.name: f for f in (  # issue 59: 4-bit on a GPU's small batches (cuda_formats)
    WeightFormat("int4", "4-bit weights on torch's int4 kernel (tinygemm, groups of 128)", _dense,
                 cuda_formats.convert_int4, devices=("cuda",), missing=cuda_formats.missing_int4),
    WeightFormat("int4-torchao", "4-bit weights on torch's int4 kernel through torchao (groups of 128)", _dense,
                 cuda_formats.convert_int4_torchao, devices=("cuda",), missing=cuda_formats.missing_int4_torchao,
                 libraries=("torchao",)),
    WeightFormat("gemlite", "4-bit HQQ weights on gemlite's Triton kernels through torchao (groups of 128)", _dense,
                 cuda_formats.convert_gemlite, devices=("cuda",), missing=cuda_formats.missing_gemlite,
                 libraries=("torchao", "gemlite")),
)})
QUANTIZATIONS = ("auto", *FORMATS)  # "auto": the fastest format on this machine within the quality tolerance
PROBED = tuple(name for name, f in FORMATS.items() if f.probed)  # the formats "auto" tries


def choices_text() -> str:
    """``QUANTIZATIONS`` for a help text, each format made for some devices only followed by them:
    "auto | nf4 | ... | q4 (cpu) | ..."."""
    return " | ".join(q if q not in FORMATS or FORMATS[q].devices is None
                      else f"{q} ({', '.join(FORMATS[q].devices)})" for q in QUANTIZATIONS)


def probed_for(device: str) -> tuple[str, ...]:
    """The formats ``auto`` tries on ``device``: ``PROBED`` less those made for other devices."""
    kind = torch.device(device).type
    return tuple(n for n in PROBED if FORMATS[n].devices is None or kind in FORMATS[n].devices)


def missing_kernel(name: str, device: str) -> str | None:
    """None where format ``name``'s kernel runs on ``device``; else one line naming what is missing."""
    fmt = FORMATS[name]
    return None if fmt.missing is None else fmt.missing(device)


def fallback(name: str, device: str) -> tuple[str, str | None]:
    """The format to load for ``name`` on ``device`` and the line saying why it is not ``name``: NF4 where
    ``name`` is made for this kind of device but its kernel is missing here (``missing_kernel``), else ``name``
    and None (a format for another kind of device is ``format_of``'s error)."""
    devices = FORMATS[name].devices if name in FORMATS else None
    if devices is not None and torch.device(device).type not in devices:
        return name, None
    reason = missing_kernel(name, device) if name in FORMATS else None
    if reason is None:
        return name, None
    return "nf4", f"hf-adaspec: quantization={name!r} is not available here ({reason}); NF4 used"


def check_options(quantization: str, dtype: str) -> None:
    """Raises ValueError for a quantization outside ``QUANTIZATIONS`` or a dtype outside ``DTYPES``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}; choose one of {QUANTIZATIONS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {tuple(DTYPES)}")


def format_of(name: str, device: str) -> WeightFormat:
    """The registered format ``name`` for ``device``.
    Raises ValueError: "auto" or an unknown name; a format that does not run on ``device``."""
    if name not in FORMATS:
        raise ValueError(f"quantization={name!r} names no weight format; choose one of {tuple(FORMATS)}")
    fmt = FORMATS[name]
    kind = torch.device(device).type
    if fmt.devices is not None and kind not in fmt.devices:
        raise ValueError(f"quantization={name!r} runs on {', '.join(fmt.devices)} only, not {kind}; "
                         f"choose one of {tuple(n for n, f in FORMATS.items() if f.devices is None)}")
    return fmt


def model_kwargs(quantization: str, dtype: str, device: str, quantize_lm_head: bool) -> dict:
    """``from_pretrained`` keywords for a weight format (``FORMATS``), dtype and device; a format with a
    ``convert`` step loads dense and is converted by ``convert``.
    Raises ValueError for "auto" (not a format), an unknown format or dtype, or a format not for ``device``."""
    check_options(quantization, dtype)
    fmt = format_of(quantization, device)
    kwargs: dict = {"dtype": DTYPES[dtype], "device_map": device}
    config = fmt.config(DTYPES[dtype], quantize_lm_head)
    if config is not None:
        kwargs["quantization_config"] = config
    return kwargs


def convert(model: torch.nn.Module, quantization: str, quantize_lm_head: bool) -> torch.nn.Module:
    """``model`` (loaded with ``model_kwargs``) after its format's conversion, if it has one."""
    fmt = FORMATS[quantization]
    if fmt.convert is not None:
        fmt.convert(model, quantize_lm_head)
    return model


def load_weights(source: str, name: str, quantization: str, dtype: str, device: str,
                 quantize_lm_head: bool) -> torch.nn.Module:
    """The causal LM at ``source`` (a folder or HF id ``from_pretrained`` reads) in weight format
    ``quantization`` (not "auto"), named ``name`` (a cost profile's identity names the model as asked, not a
    cache path); eval mode. Raises ValueError as ``model_kwargs``; ImportError for a format's missing library."""
    kwargs = model_kwargs(quantization, dtype, device, quantize_lm_head)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    convert(model, quantization, quantize_lm_head)
    model.config._name_or_path = name
    return model.eval()
