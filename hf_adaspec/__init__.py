"""hf-adaspec: adaptive speculative decoding for Hugging Face transformers.

Each step chooses the drafter (the draft model, prompt lookup, or none: a plain step) and the proposal
length k that maximise goodput — expected generated tokens per second — from costs measured on this
machine and acceptance learned online. Greedy output is the target's greedy output; sampling is lossless.

    import hf_adaspec
    hf_adaspec.enable(model)
    model.generate(**inputs, assistant_model=draft, speculation="adaptive")
    hf_adaspec.generate_batch(model, tokenizer, prompts, draft_model=draft)  # a static batch

Layers: ``seam`` (transformers), ``engine`` (the loop, ragged cache, verification, stats), ``proposers``,
``policy`` (goodput, acceptance, confidence, horizon, controllers, modes), ``costs``, ``models`` (assets
and loading) and ``tools`` (CLI, bench, playground). The core imports nothing from ``tools``.
"""

from .config import SPECULATION_MODES, SpeculationConfig
from .costs.table import CostTable
from .engine.stats import SpeculationStats, StepRecord
from .models.assets import AssetError
from .models.loading import LoadedModel, load
from .models.presets import DEFAULT_DRAFT, DEFAULT_TARGET, PRESETS
from .policy.goodput import expected_tokens
from .api.generate_batch import BatchGeneration, generate_batch
from .api.generate import SpeculationState, SpeculativeGenerateOutput, enable

__all__ = [
    "AssetError",
    "BatchGeneration",
    "CostTable",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "LoadedModel",
    "PRESETS",
    "SPECULATION_MODES",
    "SpeculationConfig",
    "SpeculationState",
    "SpeculationStats",
    "SpeculativeGenerateOutput",
    "StepRecord",
    "enable",
    "expected_tokens",
    "generate_batch",
    "load",
]
__version__ = "0.2.0"
