"""A model with the architecture of a preset (or of any config) and random weights, for cost profiles.

Design: a forward's cost depends on the architecture, dtype, quantization and device, not on the weight
values, so a cost profile needs no trained weights (SmartSpec, arXiv 2406.14066, profiles step costs
the same way). The presets' ``config.json`` files ship with the package (``configs/``, a few KB), so a
machine that cannot hold or receive the GGUF parts (a lent GPU) measures the profile the trained pair
will use there: the model is built from the config with seeded random weights, saved to a temporary
folder in the cache (removed after, or swept after a kill) and loaded with the same ``from_pretrained``
keywords as ``loading.load``, so its identity (parameters, dtype, quantization, device and the name it
was asked by) is the trained model's and the profile's key matches it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from ..files import sweep, temp_path
from .assets import cache_dir
from .loading import model_kwargs
from .presets import PRESETS

CONFIGS = Path(__file__).resolve().parent / "configs"


def config_path(name: str) -> Path:
    """The shipped ``config.json`` of preset ``name``.

    Raises:
        ValueError: ``name`` is not a preset with a shipped config (the message lists those).
    """
    path = CONFIGS / f"{name}.json"
    if name not in PRESETS or not path.is_file():
        shipped = ", ".join(sorted(p.stem for p in CONFIGS.glob("*.json")))
        raise ValueError(f"no shipped architecture for {name!r}; use one of {shipped}, or a folder with a config.json")
    return path


def load_architecture(name_or_path: str, quantization: str = "nf4", dtype: str = "bfloat16", device: str = "cpu",
                      quantize_lm_head: bool = False, seed: int = 0) -> torch.nn.Module:
    """A causal LM with the architecture of ``name_or_path`` (a preset, or a folder holding config.json)
    and random weights (``seed``), quantized and placed as ``loading.load`` would (same keywords); eval
    mode. For timing only: it generates noise.

    Raises:
        ValueError: unknown preset, quantization or dtype; FileNotFoundError: a folder without config.json.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    source = config_path(name_or_path) if name_or_path in PRESETS else Path(name_or_path) / "config.json"
    if not source.is_file():
        raise FileNotFoundError(f"no config.json at {source}; give a preset or a model folder")
    config = AutoConfig.from_pretrained(source)
    kwargs = model_kwargs(quantization, dtype, device, quantize_lm_head)
    root = cache_dir() / "architectures"
    root.mkdir(parents=True, exist_ok=True)
    sweep(root)
    folder = temp_path(root / Path(name_or_path).name)
    try:
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config, dtype=kwargs["dtype"]).save_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    model.config._name_or_path = name_or_path
    return model.eval()
