"""What a model is, read from its config and modules: layer types and whether speculation can roll them back,
the KV cache's shape, each attention layer type's window, the identity its costs depend on and its weights'
identity, the vocabulary and the readout a draft head starts from."""

from __future__ import annotations

import hashlib
import json
import weakref

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from transformers.cache_utils import get_layer_types_and_kwargs

ATTENTION_TYPES = ("full_attention", "sliding_attention", "chunked_attention")  # layer types speculation serves


_NO_KV = "dummy"  # transformers' type for layers that keep no keys and values (MoE/MLP-only, KV-sharing consumers)


def layer_types(model: torch.nn.Module) -> tuple[str, ...]:
    """The layer type of each decoder layer, as transformers' caches read them from the text config
    ("full_attention", "sliding_attention", "chunked_attention", "linear_attention", "conv", "dummy", …)."""
    return tuple(get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))[0])


def speculation_reason(model: torch.nn.Module) -> str | None:
    """Why speculation cannot run on ``model``, or None: layers whose state is recurrent or compressed (linear
    attention, convolutions, state-space layers such as Mamba or gated DeltaNet: transformers' "stateful"
    models) cannot drop rejected tokens, which a KV cache does by cropping columns."""
    other = sorted(set(layer_types(model)) - {*ATTENTION_TYPES, _NO_KV})
    if other or model._is_stateful:
        layers = f"{', '.join(other)} layers" if other else "layers with a recurrent state"
        return (
            f"{type(model).__name__} has {layers}, which cannot roll back rejected draft tokens; "
            "speculation needs attention layers that keep keys and values (full, sliding-window or chunked)"
        )
    return None


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int, torch.dtype]:
    """(layers, key/value heads, head dim, dtype) of ``model``'s KV cache, from its text config; the dtype is
    the input embedding's (what a quantized model computes in)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim, model.get_input_embeddings().weight.dtype


def static_kv_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run on a preallocated cache (layers other than attention layers that keep their
    keys and values: recurrent, or sharing another layer's cache), or None."""
    types = set(layer_types(model))
    if not types <= set(ATTENTION_TYPES):
        return f"its layers are {sorted(types)}; a preallocated cache serves {', '.join(ATTENTION_TYPES)} layers"
    return None


_WINDOWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → ``layer_windows`` (read per forward)


def layer_windows(model: torch.nn.Module) -> dict[str, tuple[str, int] | None]:
    """Each attention layer type of ``model`` → how its window narrows a causal mask: ("sliding", w): a query
    sees the keys less than w positions before it; ("chunked", c): the keys of its own chunk of c positions;
    None: every key (full attention)."""
    if model not in _WINDOWS:
        types, kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
        out: dict[str, tuple[str, int] | None] = {}
        for kind, extra in zip(types, kwargs, strict=True):
            if kind in ATTENTION_TYPES:
                out[kind] = None if kind == "full_attention" else (kind.split("_")[0], int(extra["sliding_window"]))
        _WINDOWS[model] = out
    return _WINDOWS[model]


_PLAIN_WEIGHTS = {"Parameter", "Tensor", "Params4bit", "Int8Params"}  # dense, or bitsandbytes (named by its config)


def model_identity(model: torch.nn.Module) -> dict:
    """What a model's costs depend on, read from its config: name (``_name_or_path``), parameter count, dtype,
    quantization method (``quantization_config.quant_method``, "None" when dense) and device; where weights
    were converted after loading (``models.formats``: tensor subclasses, this package's layers),
    "weights": their types."""
    config = model.config
    quant = getattr(config, "quantization_config", None)
    quant_method = getattr(quant, "quant_method", None) if quant is not None else None
    if isinstance(quant, dict):
        quant_method = quant.get("quant_method")
    return {
        "name": str(getattr(config, "_name_or_path", type(model).__name__)),
        "params": sum(p.numel() for p in model.parameters()),
        "dtype": str(model.dtype),
        "quantization": str(quant_method),
        "device": str(model.device),
        **({"weights": converted} if (converted := _converted(model)) else {}),
    }


def _converted(model: torch.nn.Module) -> list[str]:
    """Types of a model's converted weights: parameter tensor subclasses and layers defined in this package."""
    tensors = {type(p).__name__ for p in model.parameters()} - _PLAIN_WEIGHTS
    layers = {type(m).__name__ for m in model.modules() if type(m).__module__.startswith("hf_adaspec.")}
    return sorted(tensors | layers)


WEIGHT_SAMPLES = 64  # values read per parameter or buffer for ``weights_identity``'s fingerprint


def _stored(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``tensor``'s values: itself, or a wrapper subclass's inner tensors, flattened
    (``__tensor_flatten__``: e.g. a torchao quantized weight's packed values and scales)."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()
    return [inner for name in names for inner in _stored(getattr(tensor, name))]


_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module → (device, dtype, its weights_identity)


def weights_identity(model: torch.nn.Module) -> str:
    """The identity of ``model``'s weights: 16 hex digits of a SHA-256 over ``model_identity`` (name, parameter
    count, dtype, quantization, device, converted weight types) and a fingerprint of the values, up to
    ``WEIGHT_SAMPLES`` values at an even stride through each parameter and buffer (in ``named_parameters``,
    ``named_buffers`` order; a wrapper subclass's inner tensors, such as a torchao quantized weight's; read as
    float32 in one copy to the host).

    Contract: two modules with equal identities, weights and sampled values get one key (a reload of the same
    state dict into a model of the same name, or a deepcopy); models of one config with other weights (another
    seed, a fine-tune that moves every tensor it touches) get different keys. The fingerprint samples: a change
    confined to values between the samples goes unseen. It is computed once per module object (kept weakly)
    and again after the module moves to another device or dtype; weights changed in place after the first
    call keep the old key. Cost: one small gather per tensor and one host copy (12 ms for a 1.1B Llama on a CPU,
    203 tensors; later calls about 50 µs, reading the device and dtype)."""
    placed = (str(model.device), str(model.dtype))
    kept = _WEIGHTS.get(model)
    if kept is not None and kept[:2] == placed:
        return kept[2]
    digest = hashlib.sha256(json.dumps(model_identity(model), sort_keys=True).encode())
    samples = []
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
        for stored in _stored(tensor.detach()):
            flat = stored.reshape(-1)
            if flat.numel():
                stride = max(1, flat.numel() // WEIGHT_SAMPLES)
                samples.append(flat[::stride][:WEIGHT_SAMPLES].float())
    if samples:
        digest.update(torch.cat([s.to(samples[0].device) for s in samples]).cpu().numpy().tobytes())
    _WEIGHTS[model] = (*placed, digest.hexdigest()[:16])
    return _WEIGHTS[model][2]


def vocab_size(model: torch.nn.Module) -> int:
    """Width of the logits' last dim: the output head's ``out_features`` (also for quantized heads)."""
    return model.get_output_embeddings().out_features


def readout(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM's readout as float32 on its device: the dense output head's weight [V, H] and the final
    RMSNorm's weight [H] (a draft head is initialised from them). Raises ValueError when the output head
    is quantized (load the target with a dense head: bitsandbytes keeps it dense by default)."""
    weight = model.get_output_embeddings().weight
    if weight.dim() != 2 or weight.shape[1] != model.config.get_text_config().hidden_size:
        raise ValueError(
            f"the output head's weight is {tuple(weight.shape)}: a quantized head; load the target "
            "with a dense output head"
        )
    return weight.detach().float(), model.get_decoder().norm.weight.detach().float()
