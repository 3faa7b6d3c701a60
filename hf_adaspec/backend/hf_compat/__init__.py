"""Every touch of transformers internals lives in this package: what a model is (``model_facts``), its KV cache
layers and their operations (``cache_layers``), a q4 model's lean attention (``lean_attention``), the attention a
speculative request swaps in (``speculative_attention``), attention masks for rows with holes and windowed layers
(``masks``), calling the model (``model_calls``; a q4 model's steps as one flat loop: ``flat_forward``, plain
``generate``'s too: ``flat_generate``), the
``generate`` keywords the custom_generate path reads or drops (``generate_options``), and how far its stopping
criteria and logits processors can be read over a whole span (``criteria``). The rest of hf-adaspec imports only
the names below (``hf_compat.new_cache``, …).

Tested against transformers 5.x (see pyproject's pin). The engine calls only these functions, so a transformers
upgrade that moves an internal breaks this package alone.
"""

from .cache_layers import (
    cache_length,
    cache_tensors,
    column_cache,
    copy_cache,
    dynamic_cache_of,
    new_cache,
    rollback,
    select_rows,
    synthetic_cache,
)
from .criteria import StopSplit, position_free, split_stopping
from .flat_generate import use_flat_forward
from .generate_options import (
    ASSISTED_GENERATION_OPTIONS,
    assisted_generation_options,
    eos_token_ids,
    pad_token_id,
    stop_strings_as_criteria,
)
from .lean_attention import use_lean_attention
from .masks import layer_masks
from .model_calls import PACKED_SDPA, forward, forward_logits, input_device, raw_forward, use_packed_attention
from .model_facts import (
    ATTENTION_TYPES,
    kv_shape,
    layer_types,
    model_identity,
    readout,
    speculation_reason,
    static_kv_reason,
    vocab_size,
    weights_identity,
)
from .speculative_attention import AttentionSwap, speculative_attention

__all__ = [
    "ASSISTED_GENERATION_OPTIONS",
    "ATTENTION_TYPES",
    "AttentionSwap",
    "PACKED_SDPA",
    "StopSplit",
    "position_free",
    "split_stopping",
    "assisted_generation_options",
    "cache_length",
    "cache_tensors",
    "column_cache",
    "copy_cache",
    "dynamic_cache_of",
    "eos_token_ids",
    "forward",
    "forward_logits",
    "input_device",
    "kv_shape",
    "layer_masks",
    "layer_types",
    "model_identity",
    "new_cache",
    "pad_token_id",
    "raw_forward",
    "readout",
    "rollback",
    "select_rows",
    "speculation_reason",
    "speculative_attention",
    "static_kv_reason",
    "stop_strings_as_criteria",
    "synthetic_cache",
    "use_flat_forward",
    "use_lean_attention",
    "use_packed_attention",
    "vocab_size",
    "weights_identity",
]
