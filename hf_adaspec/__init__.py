"""hf-adaspec: adaptive speculative decoding for Hugging Face transformers.

Each step chooses the drafter (the draft model, prompt lookup, or none: a plain step) and the proposal
length k that maximise goodput — expected generated tokens per second — from costs measured on this
machine and acceptance learned online. Greedy output is the target's greedy output; sampling is lossless.

    import hf_adaspec
    hf_adaspec.enable(model)
    model.generate(**inputs, assistant_model=draft, speculation="adaptive")
    hf_adaspec.generate_batch(model, tokenizer, prompts, draft_model=draft)  # a static batch
    model.generate(**inputs, assistant_model=hf_adaspec.load_head(path, model), speculation="adaptive")  # EAGLE-3

Layers, from the bottom (each imports only those below it; ``tests/test_architecture.py`` checks):
``files``/``config``; ``models`` (assets, loading, the EAGLE-3 head); ``backend`` (every touch of transformers
internals, every KV cache and the one place a request's are made, the draft's prefix store); ``costs`` and
``proposers`` (the drafters); ``policy`` (goodput, acceptance models, controllers, the registry of modes);
``engine`` (the loop, verification, the run builder); ``api`` (``enable``, ``generate_batch``) and this
package; around it, wings by purpose: ``bench`` and ``playground``, ``replay`` (traces, replay, the vLLM
export), ``training`` (draft heads), and on top ``cli`` and ``gpu_check``.
"""

from .api.generate import SpeculativeGenerateOutput, compile_steps, enable
from .api.generate_batch import BatchGeneration, generate_batch
from .config import SPECULATION_MODES, SpeculationConfig
from .costs.table import CostTable
from .engine.run import SpeculationState
from .engine.stats import SpeculationStats, StepRecord
from .models.assets import AssetError
from .models.eagle3 import Eagle3Head
from .models.eagle3_format import load_head, save_head
from .models.loading import LoadedModel, load
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
    "compile_steps",
    "enable",
    "expected_tokens",
    "generate_batch",
    "load",
    "load_head",
    "save_head",
]
__version__ = "0.2.0"
