"""Loading a model in a weight format (``formats.FORMATS``): ``from_pretrained``'s keywords, the conversion after a
dense load, and a GGUF file's own blocks built directly.

Design: ``formats`` says how each format is made; this module applies a recipe to a source (``formats.Source``).
A format that reads a GGUF file (``WeightFormat.reads_gguf``) builds the model from the file's blocks
(``gguf_weights.build``), so no dense copy is written to disk; where that refuses the architecture, or for any other
format, dense weights are loaded through ``from_pretrained`` with the format's ``quantization_config`` and then
converted (``WeightFormat.convert``). The model is named as asked, not by the cache path it loaded from, so a cost
profile's identity follows the model and not the file. Which format to load is ``format_choice``'s.
"""

from __future__ import annotations

import torch

from .formats import DTYPES, FORMATS, Source, check_options, finish_q4, format_of, kernel_dir


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


def _from_gguf(
    source: Source, quantization: str, dtype: torch.dtype, device: str, quantize_lm_head: bool
) -> torch.nn.Module | None:
    """``gguf_weights.build`` for a format that ``reads_gguf``, on ``device``; None where it refuses the architecture,
    or for ``none`` where the kernel (its dequantizer) cannot be built. Raises KernelUnavailable for ``q4``."""
    from ..kernels.q4 import KernelUnavailable
    from .gguf_weights import build

    try:
        directory = kernel_dir()
    except KernelUnavailable:
        if quantization != "none":
            raise
        return None
    model = build(source.gguf, source.meta(), dtype, quantize_lm_head, directory, kernel=quantization != "none")
    if model is not None and quantization != "none":
        finish_q4(model, directory)
    return model.to(device) if model is not None and torch.device(device).type != "cpu" else model


def load_weights(
    source: str | Source, name: str, quantization: str, dtype: str, device: str, quantize_lm_head: bool
) -> torch.nn.Module:
    """The causal LM at ``source`` (a ``Source``, or a folder or HF id ``from_pretrained`` reads) in weight format
    ``quantization`` (not "auto"), named ``name`` (a cost profile's identity names the model as asked, not a
    cache path); eval mode. A format that ``reads_gguf`` builds a GGUF source from the file's blocks
    (``gguf_weights.build``; its dense path where that refuses the architecture); the others load dense weights.
    Raises ValueError as ``model_kwargs``; ImportError for a format's missing library; KernelUnavailable."""
    kwargs = model_kwargs(quantization, dtype, device, quantize_lm_head)
    source = source if isinstance(source, Source) else Source(source)
    from transformers import AutoModelForCausalLM

    model = None
    reads = FORMATS[quantization].reads_gguf and not (quantization == "none" and source.has_dense)
    if reads and source.gguf is not None:  # dense weights: the copy on disk where there is one (same values)
        model = _from_gguf(source, quantization, kwargs["dtype"], device, quantize_lm_head)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(source.dense(), **kwargs)
        convert(model, quantization, quantize_lm_head)
    model.config._name_or_path = name
    return model.eval()
