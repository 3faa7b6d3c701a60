"""A model with the architecture of a preset (or of any config) and random weights, for cost profiles.

Design: a forward's cost depends on the architecture, dtype, quantization and device, not on the weight
values, so a cost profile needs no trained weights (SmartSpec, arXiv 2406.14066, profiles step costs
the same way). The presets' ``config.json`` files ship with the package (``configs/``, a few KB), so a
machine that cannot hold or receive the GGUF parts (a lent GPU) measures the profile the trained pair
will use there: the model is built from the config with seeded random weights, saved to a temporary
folder in the cache (removed after, or swept after a kill) and loaded with the same ``from_pretrained``
keywords as ``loading.load``, so its identity (parameters, dtype, quantization, device and the name it
was asked by) is the trained model's and the profile's key matches it. ``qwen2.5-7b`` ships as an
architecture only (Qwen2.5-7B-Instruct's config.json, no model files): the size of target consumer-GPU users
run, profiled with the 0.5B draft. Its output head is 152,064 wide, the 0.5B's 151,936 (the same tokenizer,
151,665 tokens; both heads are padded): the engine pads the draft's logits to the target's width.
"""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from ..files import sweep, temp_path
from .assets import cache_dir
from .loading import model_kwargs

CONFIGS = Path(__file__).resolve().parent / "configs"


def _shipped(name: str) -> bool:
    """``name`` names a shipped config: a preset's, or an architecture-only entry such as ``qwen2.5-7b``."""
    return "/" not in name and (CONFIGS / f"{name}.json").is_file()


def config_path(name: str) -> Path:
    """The shipped ``config.json`` of ``name``: a preset's, or an architecture-only entry (``qwen2.5-7b``:
    Qwen2.5-7B-Instruct's config, for costs on a GPU; no model files are shipped for it).

    Raises:
        ValueError: ``name`` has no shipped config (the message lists those).
    """
    if not _shipped(name):
        shipped = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
        raise ValueError(f"no shipped architecture for {name!r}; use one of {shipped}, or a folder with a config.json")
    return CONFIGS / f"{name}.json"


@contextlib.contextmanager
def architecture_folder(name_or_path: str, dtype: str = "bfloat16", seed: int = 0,
                        build_device: str = "cpu") -> Iterator[Path]:
    """``with architecture_folder(name) as folder:`` a saved model with the architecture of ``name_or_path``
    (a shipped config's name, or a folder holding config.json) and random weights (``seed``), built on
    ``build_device`` (a GPU builds a large model in seconds), in a temporary folder of the cache that is
    removed after (or swept after a kill). Load it as often as needed with ``load_saved``.

    Raises:
        FileNotFoundError: a folder without config.json; ValueError: an unknown dtype.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    source = config_path(name_or_path) if _shipped(name_or_path) else Path(name_or_path) / "config.json"
    if not source.is_file():
        raise FileNotFoundError(f"no config.json at {source}; give a preset or a model folder")
    config = AutoConfig.from_pretrained(source)
    root = cache_dir() / "architectures"
    root.mkdir(parents=True, exist_ok=True)
    sweep(root)
    folder = temp_path(root / Path(name_or_path).name)
    try:
        torch.manual_seed(seed)
        with torch.device(build_device):
            model = AutoModelForCausalLM.from_config(config, dtype=model_kwargs("none", dtype, "cpu", False)["dtype"])
        model.save_pretrained(folder)
        del model
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def load_saved(folder: Path, name_or_path: str, quantization: str = "nf4", dtype: str = "bfloat16",
               device: str = "cpu", quantize_lm_head: bool = False) -> torch.nn.Module:
    """The model saved in ``folder`` by ``architecture_folder``, loaded with ``loading.load``'s keywords and
    named ``name_or_path`` (so its identity, and a profile's key, are the trained model's); eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, **model_kwargs(quantization, dtype, device, quantize_lm_head))
    model.config._name_or_path = name_or_path
    return model.eval()


def load_architecture(name_or_path: str, quantization: str = "nf4", dtype: str = "bfloat16", device: str = "cpu",
                      quantize_lm_head: bool = False, seed: int = 0, build_device: str = "cpu") -> torch.nn.Module:
    """A causal LM with the architecture of ``name_or_path`` (a shipped config's name, or a folder holding
    config.json) and random weights (``seed``), quantized and placed as ``loading.load`` would (same
    keywords); eval mode. For timing only: it generates noise.

    Raises:
        ValueError: unknown preset, quantization or dtype; FileNotFoundError: a folder without config.json.
    """
    model_kwargs(quantization, dtype, device, quantize_lm_head)  # unknown options fail before anything is built
    with architecture_folder(name_or_path, dtype, seed, build_device) as folder:
        return load_saved(folder, name_or_path, quantization, dtype, device, quantize_lm_head)
