"""hf-adaspec: adaptive speculative decoding for Hugging Face transformers.

Each step chooses the drafter (the draft model, prompt lookup, or none: a plain step) and the proposal
length k that maximise goodput — expected generated tokens per second — from costs measured on this
machine and acceptance learned online. Greedy output is the target's greedy output; sampling is lossless.

    import hf_adaspec
    hf_adaspec.enable(model)
    model.generate(**inputs, assistant_model=draft, speculation="adaptive")
    hf_adaspec.generate_batch(model, tokenizer, prompts, draft_model=draft)  # a static batch
    model.generate(**inputs, assistant_model=hf_adaspec.load_head(path, model), speculation="adaptive")  # EAGLE-3

One step, the layers the folders stack in (each imports only those below it) and what each folder holds:
ARCHITECTURE.md at the repository root, the one place the layer list is written (``tests/test_architecture.py``
reads it and checks every import).
"""

from .api.generate import TARGET_WIDTHS, SpeculativeGenerateOutput, compile_steps, enable
from .api.generate_batch import BatchGeneration, generate_batch
from .api.load import load
from .config import SPECULATION_MODES, SpeculationConfig
from .costs.table import CostTable
from .engine.run import SpeculationState
from .engine.stats import SpeculationStats, StepRecord
from .models.assets import AssetError
from .models.eagle3 import Eagle3Head
from .models.eagle3_format import load_head, save_head
from .models.loading import LoadedModel
from .models.presets import DEFAULT_DRAFT, DEFAULT_TARGET, PRESETS
from .policy.goodput import expected_tokens

__all__ = [
    "AssetError",
    "BatchGeneration",
    "CostTable",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "Eagle3Head",
    "LoadedModel",
    "PRESETS",
    "SPECULATION_MODES",
    "SpeculationConfig",
    "SpeculationState",
    "SpeculationStats",
    "SpeculativeGenerateOutput",
    "StepRecord",
    "TARGET_WIDTHS",
    "compile_steps",
    "enable",
    "expected_tokens",
    "generate_batch",
    "load",
    "load_head",
    "save_head",
]
__version__ = "0.2.0"
