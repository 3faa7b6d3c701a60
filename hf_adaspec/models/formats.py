"""Weight formats a model can be loaded in: a registry of how each is made.

Design: the fastest format depends on the processor, not on the model: bitsandbytes' NF4 runs its
fused 4-bit kernel only where the CPU has AVX512-BF16 and dequantizes every weight before multiplying
elsewhere, while our q4 kernel (integer dot products on AVX512-VNNI or AVX2) and dense bf16 matmuls run on any
x86-64 CPU with AVX2 (without AVX512-BF16, NF4's forward is several times dense bf16's: docs/experiments.md). So
a format is only a recipe; which one loads is decided by timing on the running machine
(``format_choice``). Each ``WeightFormat`` gives the ``quantization_config`` handed to ``from_pretrained``
(bitsandbytes) and/or a conversion applied after a dense load (``q4``: its layers replace ``nn.Linear``).

- ``nf4``: bitsandbytes 4-bit NormalFloat, blocks of 64, compute in the model's dtype.
- ``int8``: bitsandbytes LLM.int8().
- ``q4``: our kernel (``kernels/q4``): block-quantized weights times activations quantized to 8 bits per 256
  (llama.cpp's K-quants x Q8_K), integer dot products on AVX512-VNNI or AVX2 (plain C elsewhere). CPU only. A model
  from a GGUF file keeps the file's own blocks (``gguf_weights``: Q4_K, Q6_K, Q8_0, Q5_0, Q4_0 exact); dense weights are
  quantized to Q4_K.
- ``none``: dense weights in the requested dtype.
- ``int4``, ``int4-torchao``, ``gemlite``: 4-bit formats for a GPU's small batches of rows (``cuda_formats``).

The output head stays dense unless ``quantize_lm_head`` (a draft's head is a large share of its step).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import cuda_formats

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class Source:
    """Where a model loads from: ``path``, a folder or HF id ``from_pretrained`` reads (config, tokenizer and dense
    weights); or, for a GGUF file, ``gguf``, with ``meta_path`` (a callable giving a folder of its config, tokenizer
    and tensor index, ``gguf_weights.INDEX``) and ``dense_path`` (one giving a folder of its dequantized weights),
    each made on its first call; ``has_dense``: that folder was there already."""

    path: str = ""
    gguf: Path | None = None
    meta_path: Callable[[], str] | None = None
    dense_path: Callable[[], str] | None = None
    has_dense: bool = False

    def dense(self) -> str:
        """A folder or HF id with dense weights (and config and tokenizer) that ``from_pretrained`` reads."""
        return self.dense_path() if self.dense_path is not None else self.path

    def meta(self) -> str:
        """A folder or HF id with the config and tokenizer."""
        return self.meta_path() if self.meta_path is not None else self.path


@dataclass(frozen=True)
class WeightFormat:
    """How a format is made: ``config(dtype, quantize_lm_head)`` → the ``quantization_config`` for
    ``from_pretrained`` (None: a dense load), ``convert(model, quantize_lm_head)`` applied after loading
    (None: nothing), the devices it runs on (None: any), whether ``auto`` tries it (``probed``) and whether it
    reads a GGUF source itself (``reads_gguf``: its blocks, or for ``none`` its values dequantized in memory; no dense
    copy on disk needed). ``missing(device)``: None where its kernel runs on ``device``, else one line naming what
    is missing (None: it always runs); ``libraries``: packages whose versions key a timed choice that tried it;
    ``quantize_head(model, source)``: a loaded model's output head as a load with ``quantize_lm_head`` makes it, for
    a model loaded with a dense head (None: the format's head variant is loaded again)."""

    name: str
    summary: str
    config: Callable[[torch.dtype, bool], object | None]
    convert: Callable[[torch.nn.Module, bool], None] | None = None
    devices: tuple[str, ...] | None = None
    probed: bool = True
    missing: Callable[[str], str | None] | None = None
    libraries: tuple[str, ...] = ()
    reads_gguf: bool = False
    quantize_head: Callable[[torch.nn.Module, Source], torch.nn.Module] | None = None

    def __post_init__(self) -> None:
        if not self.name or not self.summary:
            raise ValueError("a weight format needs a name and a summary")


def _bnb_nf4(dtype: torch.dtype, quantize_lm_head: bool):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=dtype,
        llm_int8_skip_modules=[] if quantize_lm_head else None,
    )  # None: head stays dense


def _bnb_int8(dtype: torch.dtype, quantize_lm_head: bool):
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=[] if quantize_lm_head else None)


def _dense(dtype: torch.dtype, quantize_lm_head: bool) -> None:
    return None


def kernel_dir() -> Path:
    """Where the q4 kernel is built (``<cache>/kernels``), after building it. Raises KernelUnavailable (a
    RuntimeError) naming the fix where it cannot be built here."""
    from ..kernels import q4
    from .assets import cache_dir

    directory = cache_dir() / "kernels"
    q4.library(directory)  # fails here, before any layer is replaced, where the kernel cannot be built
    return directory


FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # siblings that read the same input


def finish_q4(model: torch.nn.Module, directory: Path) -> None:
    """The modules around the kernel calls made lean where their forward is known (``lean_layer``: RMSNorm, a gated
    MLP with its gate and up as one call); each remaining module's query/key/value and gate/up ``Q4Linear``
    children (``FUSED``; same input width) to one kernel call (``kernels.fused``), other layers left as they are;
    then every q4 layer's dense route set (``route_choice.apply``: measured at the first load on this machine)."""
    from ..kernels import fused, q4_layer
    from .lean_layer import lean
    from .route_choice import apply

    lean(model, directory)
    for module in list(model.modules()):
        for names in FUSED:
            layers = [getattr(module, name, None) for name in names]
            if (
                all(isinstance(layer, q4_layer.Q4Linear) for layer in layers)
                and len({layer.in_features for layer in layers}) == 1
            ):
                for name, piece in zip(names, fused.fuse(layers, directory)):
                    setattr(module, name, piece)
    apply(model)


def _q4(model: torch.nn.Module, quantize_lm_head: bool) -> None:
    """Every linear layer whose input features are a multiple of 32 (the output head only with
    ``quantize_lm_head``; a tied input embedding keeps its dense table) to ``kernels.q4_layer.Q4Linear`` with Q4_K
    blocks. Raises KernelUnavailable as ``kernel_dir``."""
    from ..kernels import q4_layer

    directory = kernel_dir()
    head = model.get_output_embeddings()
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if (
                isinstance(child, torch.nn.Linear)
                and child.in_features % 32 == 0
                and (quantize_lm_head or child is not head)
            ):
                setattr(module, child_name, q4_layer.Q4Linear.dense(child, directory))
    finish_q4(model, directory)


def q4_head(model: torch.nn.Module, source: str | Source) -> torch.nn.Module:
    """``model``'s output head as ``load_weights(..., "q4", ..., quantize_lm_head=True)`` makes it, for a model already
    loaded with a dense head: a ``kernels.q4_layer.Q4Linear`` on the GGUF file's own blocks where ``source`` is a file
    that ``q4`` reads (``gguf_weights.reads_exactly``), else on its dense weight quantized to Q4_K.
    Raises KernelUnavailable as ``kernel_dir``; ValueError for a head whose input features are not a multiple
    of 32."""
    from ..kernels.q4_layer import Q4Linear
    from ..kernels.route import layers
    from .gguf_weights import head_rows, reads_exactly

    head, directory = model.get_output_embeddings(), kernel_dir()
    if head.in_features % 32:
        raise ValueError(f"an output head over {head.in_features} features has no q4 layout (a multiple of 32)")
    if isinstance(source, Source) and source.gguf is not None and reads_exactly(source.gguf, source.meta()):
        rows = head_rows(source.gguf, source.meta(), head.in_features, directory)
        layer = Q4Linear(head.in_features, [rows], head.bias, directory)
    else:
        layer = Q4Linear.dense(head, directory)
    layer.dense_rows = next((m.dense_rows for m in layers(model)), None)  # the body's route (``finish_q4``)
    return layer


FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("nf4", "bitsandbytes NF4", _bnb_nf4),
        # int8: 2.5–7x the best format's step on both CPU paths measured (docs/experiments.md); loaded when asked for
        WeightFormat("int8", "bitsandbytes LLM.int8()", _bnb_int8, probed=False),
        WeightFormat(
            "q4",
            "a GGUF file's own blocks (dense weights: Q4_K) x 8-bit activations, VNNI/AVX2 (our kernel)",
            _dense,
            _q4,
            devices=("cpu",),
            reads_gguf=True,
            quantize_head=q4_head,
        ),
        WeightFormat("none", "dense", _dense, reads_gguf=True),
    )
}
# 4-bit for a GPU's 1 to k + 1 rows, where NF4 verifies at twice a step's cost (cuda_formats)
FORMATS.update(
    {
        f.name: f
        for f in (
            WeightFormat(
                "int4",
                "4-bit weights on torch's int4 kernel (tinygemm, groups of 128)",
                _dense,
                cuda_formats.convert_int4,
                devices=("cuda",),
                missing=cuda_formats.missing_int4,
            ),
            WeightFormat(
                "int4-torchao",
                "4-bit weights on torch's int4 kernel through torchao (groups of 128)",
                _dense,
                cuda_formats.convert_int4_torchao,
                devices=("cuda",),
                missing=cuda_formats.missing_int4_torchao,
                libraries=("torchao",),
            ),
            WeightFormat(
                "gemlite",
                "4-bit HQQ weights on gemlite's Triton kernels through torchao (groups of 128)",
                _dense,
                cuda_formats.convert_gemlite,
                devices=("cuda",),
                missing=cuda_formats.missing_gemlite,
                libraries=("torchao", "gemlite"),
            ),
        )
    }
)
QUANTIZATIONS = ("auto", *FORMATS)  # "auto": the fastest format on this machine within the quality tolerance
PROBED = tuple(name for name, f in FORMATS.items() if f.probed)  # the formats "auto" tries


def choices_text() -> str:
    """``QUANTIZATIONS`` for a help text, each format made for some devices only followed by them:
    "auto | nf4 | ... | q4 (cpu) | ..."."""
    return " | ".join(
        q if q not in FORMATS or FORMATS[q].devices is None else f"{q} ({', '.join(FORMATS[q].devices)})"
        for q in QUANTIZATIONS
    )


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
        raise ValueError(
            f"quantization={name!r} runs on {', '.join(fmt.devices)} only, not {kind}; "
            f"choose one of {tuple(n for n, f in FORMATS.items() if f.devices is None)}"
        )
    return fmt
