"""Load a target or draft model: preset name, local GGUF file, local directory or HF id.

Path for presets: assembled GGUF (``assets``) → transformers' GGUF loader with
``GgufConfig(dequantize=True)`` → dense weights, cached once as safetensors (written to a temporary
directory, renamed into place; the assembled GGUF is then discarded, so a preset keeps one copy on
disk beside its installed parts) → optionally bitsandbytes NF4/int8 at load. Measured on a 2-core CPU:
NF4 (bf16 compute) is the fastest path for the Qwen2.5-Coder pair, so it is the CPU default.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .assets import assemble, cache_dir, discard
from .presets import PRESETS

QUANTIZATIONS = ("nf4", "int8", "none")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DONE = "ADASPEC_COMPLETE"


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode, its tokenizer and the name it was loaded from."""

    model: torch.nn.Module
    tokenizer: object
    name: str


def _check_options(quantization: str, dtype: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}; choose one of {QUANTIZATIONS}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; choose one of {tuple(DTYPES)}")


def _dense_from_gguf(gguf: Path, dest: Path, dtype: str) -> Path:
    """Dequantize a GGUF file once into a safetensors directory ``dest`` (atomic: temp dir + rename)."""
    if (dest / _DONE).exists():
        return dest
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=DTYPES[dtype], quantization_config=GgufConfig(dequantize=True)
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE).write_text(gguf.name + "\n")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def resolve(name_or_path: str, dtype: str = "bfloat16") -> str:
    """A directory or HF id that ``from_pretrained`` can load: presets and ``.gguf`` files are
    dequantized into the cache first. Raises AssetError for missing model parts."""
    if name_or_path in PRESETS:
        asset, dest = PRESETS[name_or_path].asset, cache_dir() / "dense" / f"{name_or_path}-{dtype}"
        if not (dest / _DONE).exists():
            _dense_from_gguf(assemble(asset), dest, dtype)
            discard(asset)
        return str(dest)
    if name_or_path.endswith(".gguf"):
        gguf = Path(name_or_path).resolve()
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf}")
        return str(_dense_from_gguf(gguf, cache_dir() / "dense" / f"{gguf.stem}-{dtype}", dtype))
    return name_or_path


def load(
    name_or_path: str,
    quantization: str = "nf4",
    dtype: str = "bfloat16",
    device: str = "cpu",
    quantize_lm_head: bool = False,
) -> LoadedModel:
    """Load a causal LM and tokenizer; ``quantization`` nf4|int8|none (bitsandbytes), ``dtype`` the
    weight/compute dtype. ``quantize_lm_head`` also quantizes the output head (bitsandbytes skips it by
    default): worth it for a draft model, whose 151,936-row head is a third of its CPU forward (0.5B
    NF4: 35 → 23 ms per token, ``python benchmarks/draft_head.py``).

    Raises:
        ValueError: unknown quantization or dtype.
        AssetError: a preset's model part is missing or fails its hash (names the pip command).
    """
    _check_options(quantization, dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    source = resolve(name_or_path, "float32" if dtype == "float32" else "bfloat16")
    kwargs: dict = {"dtype": DTYPES[dtype], "device_map": device}
    skip = [] if quantize_lm_head else None  # None: bitsandbytes keeps the output head dense
    if quantization == "nf4":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=DTYPES[dtype], llm_int8_skip_modules=skip
        )
    elif quantization == "int8":
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    model = AutoModelForCausalLM.from_pretrained(source, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(source)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name_or_path)
