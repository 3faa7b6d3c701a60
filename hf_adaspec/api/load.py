"""``hf_adaspec.load``: a model and tokenizer as ``models.loading.load`` builds them, and, for a model it put on the
q4 kernel, the attention the engine's steps run made the model's own.

Design: a q4 model is ours, not one transformers built: its linear layers are the kernel's, its norms and MLPs the
lean modules (``models.lean_layer``). Its attention is made lean at load too, so plain ``generate`` runs what a
speculative request's steps run (``hf_compat.use_packed_attention``: the same SDPA computation with grouped-query
heads packed on a CPU; ``hf_compat.use_lean_attention``: the fused query/key/value split and rotated in one C
call), and its decoding steps run as the engine's do (``hf_compat.use_flat_forward``: one flat loop over the
layers, the same logits). A model loaded elsewhere and passed to ``enable`` keeps its own attention and forward
outside speculative requests.
"""

from __future__ import annotations

import functools

from ..backend import hf_compat
from ..models import loading
from ..models.loading import LoadedModel


@functools.wraps(loading.load, assigned=())  # its signature (``__wrapped__``); this docstring
def load(*args, **kwargs) -> LoadedModel:
    """``models.loading.load`` (its arguments, what it returns, its errors; the format ``auto`` chooses is
    measured at the first load on this machine); where the weights are ``q4``, the model's attention is the
    packed, lean one and its decoding steps flat (module docstring) for plain ``generate`` as well as for
    speculative requests."""
    loaded = loading.load(*args, **kwargs)
    if loaded.weight_format == "q4":
        hf_compat.use_packed_attention(loaded.model)
        hf_compat.use_lean_attention(loaded.model)
        hf_compat.use_flat_forward(loaded.model)
    return loaded
