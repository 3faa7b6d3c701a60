"""hf-adaspec: adaptive speculative decoding for Hugging Face transformers.

Each step chooses the proposal length k (down to 0, a plain step) that maximises goodput — expected
generated tokens per second — from a cost table measured on this machine and an online estimate of
the acceptance rate α. Greedy output is the target's greedy output; sampling is lossless.

    import hf_adaspec
    hf_adaspec.enable(model)
    model.generate(**inputs, assistant_model=draft, speculation="adaptive")
    hf_adaspec.generate_batch(model, tokenizer, prompts, draft_model=draft)  # a static batch
"""

from .acceptance import AcceptanceEstimator, AcceptancePrior
from .assets import AssetError
from .costs import CostTable
from .goodput import best_k, expected_tokens
from .generate_batch import BatchGeneration, generate_batch
from .config import SpeculationConfig
from .integration import SpeculationState, SpeculativeGenerateOutput, enable
from .loading import LoadedModel, load
from .presets import DEFAULT_DRAFT, DEFAULT_TARGET, PRESETS
from .stats import BatchSpeculationStats, BatchStepRecord, SpeculationStats, StepRecord

__all__ = [
    "AcceptanceEstimator",
    "AcceptancePrior",
    "AssetError",
    "BatchGeneration",
    "BatchSpeculationStats",
    "BatchStepRecord",
    "CostTable",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "LoadedModel",
    "PRESETS",
    "SpeculationConfig",
    "SpeculationState",
    "SpeculationStats",
    "SpeculativeGenerateOutput",
    "StepRecord",
    "best_k",
    "enable",
    "expected_tokens",
    "generate_batch",
    "load",
]
__version__ = "0.1.0"
