"""A model with the architecture of a preset (or of any config) and random weights, for cost profiles.

Design: a forward's cost depends on the architecture, dtype, quantization and device, not on the weight
values, so a cost profile needs no trained weights (SmartSpec, arXiv 2406.14066, profiles step costs
the same way). The presets' ``config.json`` files ship with the package (``configs/``, a few KB), so a
machine that cannot hold or receive the GGUF parts (a lent GPU) measures the profile the trained pair
will use there: the model is built from the config with seeded random weights, held in memory (a 7B's
bf16 weights would take 15 GB of disk) and loaded from its state dict with the same ``from_pretrained``
keywords as ``loading.load``, so its identity (parameters, dtype, quantization, device and the name it
was asked by) is the trained model's and the profile's key matches it. ``qwen2.5-7b`` ships as an
architecture only (Qwen2.5-7B-Instruct's config.json, no model files): the size of target consumer-GPU users
run, profiled with the 0.5B draft. Its output head is 152,064 wide, the 0.5B's 151,936 (the same tokenizer,
151,665 tokens; both heads are padded): the engine pads the draft's logits to the target's width.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .format_load import convert, model_kwargs
from .formats import FORMATS

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


@dataclass(frozen=True)
class RandomWeights:
    """A model with the architecture of ``name`` and seeded random weights, held in memory (nothing is
    written to disk): its class, config and ``state_dict`` (on the device it was built on). Load it as often
    as needed with ``load_random``."""

    name: str
    model_class: type
    config: object
    state_dict: dict


def _config_source(name_or_path: str) -> Path:
    """The config.json of a shipped architecture or a model folder. Raises FileNotFoundError: none there."""
    source = config_path(name_or_path) if _shipped(name_or_path) else Path(name_or_path) / "config.json"
    if not source.is_file():
        raise FileNotFoundError(f"no config.json at {source}; give a preset or a model folder")
    return source


def random_weights(
    name_or_path: str, dtype: str = "bfloat16", seed: int = 0, build_device: str = "cpu"
) -> RandomWeights:
    """Random weights (``seed``) with the architecture of ``name_or_path`` (a shipped config's name, or a
    folder holding config.json), in ``dtype``, built on ``build_device`` (a GPU builds a large model in
    seconds).

    Raises:
        FileNotFoundError: a folder without config.json; ValueError: an unknown dtype.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(_config_source(name_or_path))
    torch.manual_seed(seed)
    with torch.device(build_device):
        model = AutoModelForCausalLM.from_config(config, dtype=model_kwargs("none", dtype, "cpu", False)["dtype"])
    return RandomWeights(name_or_path, type(model), config, dict(model.state_dict()))


def load_random(
    weights: RandomWeights,
    quantization: str = "nf4",
    dtype: str = "bfloat16",
    device: str = "cpu",
    quantize_lm_head: bool = False,
) -> torch.nn.Module:
    """``weights`` loaded with ``loading.load``'s ``from_pretrained`` keywords (from the state dict, which is
    left unchanged) and named ``weights.name`` (so its identity, and a profile's key, are the trained
    model's); eval mode."""
    kwargs = model_kwargs(quantization, dtype, device, quantize_lm_head)
    model = weights.model_class.from_pretrained(
        None, config=weights.config, state_dict=dict(weights.state_dict), **kwargs
    )
    convert(model, quantization, quantize_lm_head)
    model.config._name_or_path = weights.name
    return model.eval()


def load_architecture(
    name_or_path: str,
    quantization: str = "nf4",
    dtype: str = "bfloat16",
    device: str = "cpu",
    quantize_lm_head: bool = False,
    seed: int = 0,
    build_device: str = "cpu",
) -> torch.nn.Module:
    """A causal LM with the architecture of ``name_or_path`` (a shipped config's name, or a folder holding
    config.json) and random weights (``seed``), quantized and placed as ``loading.load`` would (same
    keywords); eval mode. For timing only: it generates noise.

    Raises:
        ValueError: unknown preset, quantization ("auto" included) or dtype; FileNotFoundError: a folder without
            config.json.
    """
    _config_source(name_or_path)  # unknown names and options fail before anything is built
    if quantization == "auto":
        raise ValueError(
            "quantization='auto' times the model's own weights; with random weights give a format: "
            + ", ".join(FORMATS)
        )
    model_kwargs(quantization, dtype, device, quantize_lm_head)
    return load_random(
        random_weights(name_or_path, dtype, seed, build_device), quantization, dtype, device, quantize_lm_head
    )
