"""EAGLE-3 heads in the speculators checkpoint format, as vLLM loads it for ``method: eagle3``.

A head is a folder: ``config.json`` and ``model.safetensors``. The names and shapes follow speculators'
``Eagle3SpeculatorConfig`` / ``Eagle3DraftModel`` (github.com/vllm-project/speculators,
src/speculators/models/eagle3) and what vLLM reads (vllm/transformers_utils/configs/speculators:
``speculators_model_type``, ``transformer_layer_config``, ``speculators_config.proposal_methods[0]
.speculative_tokens``, ``speculators_config.verifier.name_or_path``, ``draft_vocab_size``,
``target_hidden_size``, ``norm_before_residual`` (vLLM's default when absent: true, so it is always
written), ``eagle_aux_hidden_state_layer_ids``; vllm/model_executor/models/llama_eagle3.py:
``fc.weight`` without a bias, ``layers.0.*`` (or ``midlayer.*``), ``norm.weight``, ``lm_head.weight``,
``d2t``; ``t2d`` and ``embed_tokens.weight`` optional). The embedding is the target's input embedding
and is not written (it is the target's own, and large). Written atomically.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..files import atomic_dir
from .eagle3 import Eagle3Head, HeadConfig

CONFIG, WEIGHTS = "config.json", "model.safetensors"
SPECULATORS_VERSION = "0.3.0"  # the format version written (speculators' own version field)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default feature layers for a target of ``num_layers``: (2, L // 2, L − 3), clamped to the model."""
    last = num_layers - 1
    return min(2, last), min(num_layers // 2, last), max(0, min(num_layers - 3, last))


def to_speculators(
    config: HeadConfig, speculative_tokens: int = 3, verifier_architectures: tuple[str, ...] = ()
) -> dict:
    """The ``config.json`` document of a head."""
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "attention_bias": config.attention_bias,
        "mlp_bias": False,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.target_vocab_size,
        "tie_word_embeddings": False,
    }
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": config.draft_vocab_size,
        "norm_before_residual": config.norm_before_residual,
        "target_hidden_size": config.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(config.aux_layers),
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": speculative_tokens,
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "verifier": {"name_or_path": config.verifier, "architectures": list(verifier_architectures)},
        },
    }


def from_speculators(doc: dict, target_num_layers: int) -> HeadConfig:
    """A ``HeadConfig`` from a ``config.json`` document (absent feature layers: vLLM's default for a target
    of ``target_num_layers``). Raises ValueError for another model type, a missing field, a rope scaling
    this head does not implement, or more than one decoder layer."""
    if doc.get("speculators_model_type") != "eagle3":
        raise ValueError(
            f"not an EAGLE-3 head: speculators_model_type is {doc.get('speculators_model_type')!r}, "
            "expected 'eagle3' (a speculators-format folder: config.json + model.safetensors)"
        )
    layer = doc.get("transformer_layer_config")
    if not isinstance(layer, dict) or "hidden_size" not in layer:
        raise ValueError("the head's config.json lacks transformer_layer_config.hidden_size")
    if layer.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"heads of {layer['num_hidden_layers']} decoder layers are not supported (1 is)")
    scaling = layer.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError(f"rope_scaling {scaling} is not implemented for heads; one without scaling loads")
    hidden, heads = layer["hidden_size"], layer["num_attention_heads"]
    aux = doc.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target_num_layers)
    verifier = ((doc.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
    return HeadConfig(
        hidden,
        heads,
        layer.get("num_key_value_heads", heads),
        layer["intermediate_size"],
        doc.get("target_hidden_size") or hidden,
        doc.get("draft_vocab_size") or layer["vocab_size"],
        layer["vocab_size"],
        tuple(aux),
        layer.get("head_dim") or hidden // heads,
        layer.get("rms_norm_eps", 1e-6),
        layer.get("rope_theta", 10000.0),
        bool(layer.get("attention_bias", False)),
        bool(doc.get("norm_before_residual", True)),
        layer.get("max_position_embeddings", 32768),
        verifier,
    )


def save_head(
    head: Eagle3Head, folder: str | Path, speculative_tokens: int = 3, verifier_architectures: tuple[str, ...] = ()
) -> Path:
    """Write ``head`` as a speculators-format folder (atomically: a killed write leaves no folder)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    weights = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}  # the embedding: not a submodule
    with atomic_dir(folder) as tmp:
        (tmp / CONFIG).write_text(
            json.dumps(to_speculators(head.config, speculative_tokens, verifier_architectures), indent=2) + "\n"
        )
        save_file(weights, str(tmp / WEIGHTS), metadata={"format": "pt"})
    return folder


def load_head(folder: str | Path, target: nn.Module, dtype: torch.dtype | None = None) -> Eagle3Head:
    """The head in ``folder`` for ``target`` (its input embedding is shared when the checkpoint has none),
    on the target's embedding device, in ``dtype`` (default: the checkpoint's).

    Raises:
        FileNotFoundError: the folder lacks config.json or model.safetensors.
        ValueError: not an EAGLE-3 head, a head of another target (vocabulary, hidden size, feature layers
            beyond the target's depth), or weights that do not match the config (missing, unexpected or
            mis-shaped tensors, each named).
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    for name in (CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise FileNotFoundError(
                f"{folder / name} not found; a head is a speculators-format folder "
                "(config.json + model.safetensors), e.g. written by `hf_adaspec.save_head`"
            )
    text = target.config.get_text_config()
    config = from_speculators(json.loads((folder / CONFIG).read_text()), text.num_hidden_layers)
    _check_target(config, text)
    weights = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(folder / WEIGHTS)).items()}
    embed = target.get_input_embeddings()
    if "embed_tokens.weight" in weights:
        embed = nn.Embedding.from_pretrained(weights.pop("embed_tokens.weight"), freeze=True)
    head = Eagle3Head(config, embed)
    weights.setdefault("t2d", _t2d(weights.get("d2t"), config))
    weights.setdefault("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
    _check_weights(head, weights)
    head.load_state_dict(weights, strict=False)
    return head.to(device=embed.weight.device, dtype=dtype or weights["fc.weight"].dtype).eval()


def _check_target(config: HeadConfig, text) -> None:
    if config.target_vocab_size != text.vocab_size:
        raise ValueError(
            f"the head was made for a vocabulary of {config.target_vocab_size} tokens, the target has "
            f"{text.vocab_size}: use a head trained for this target ({config.verifier or 'unknown'})"
        )
    if config.target_hidden_size != text.hidden_size:
        raise ValueError(
            f"the head reads features of width {config.target_hidden_size}, the target's is "
            f"{text.hidden_size}: use a head trained for this target ({config.verifier or 'unknown'})"
        )
    if max(config.aux_layers) >= text.num_hidden_layers:
        raise ValueError(f"the head reads layers {config.aux_layers}, the target has {text.num_hidden_layers}")


def _t2d(d2t: torch.Tensor | None, config: HeadConfig) -> torch.Tensor:
    """The target ids that have a draft id (every one when the draft vocabulary is the target's)."""
    out = torch.zeros(config.target_vocab_size, dtype=torch.bool)
    ids = torch.arange(config.draft_vocab_size) + (d2t if d2t is not None else 0)
    out[ids] = True
    return out


def _check_weights(head: Eagle3Head, weights: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming the missing, unexpected and mis-shaped tensors against the head's own."""
    own = {k: v for k, v in head.state_dict().items() if not k.startswith("embed_tokens")}
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    shapes = [
        f"{k} {tuple(weights[k].shape)} != {tuple(v.shape)}"
        for k, v in own.items()
        if k in weights and weights[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        raise ValueError(
            f"the head's weights do not match its config: missing {missing}, unexpected {unexpected}, shapes {shapes}"
        )


def random_head(
    target: nn.Module, draft_vocab_size: int = 32000, seed: int = 0, intermediate_size: int | None = None
) -> Eagle3Head:
    """A head of ``target``'s shape with random weights (``seed``), for costs (it proposes noise): the target's
    width, attention heads, RMSNorm ε and RoPE θ, vLLM's default feature layers, a draft vocabulary of the
    first ``draft_vocab_size`` target ids (at most the target's) and a decoder layer whose MLP is
    ``intermediate_size`` wide (None: the target's), so a narrower design is priced before it is trained; in
    the dtype and on the device of the target's input embedding. ``save_head`` writes both sizes into the
    speculators config (``draft_vocab_size``, ``transformer_layer_config.intermediate_size``), so a saved
    narrow head loads with its own shape.

    Raises:
        ValueError: ``draft_vocab_size`` or ``intermediate_size`` < 1.
    """
    if draft_vocab_size < 1 or (intermediate_size is not None and intermediate_size < 1):
        raise ValueError(
            f"draft_vocab_size and intermediate_size must be >= 1, got {draft_vocab_size}, {intermediate_size}"
        )
    text = target.config.get_text_config()
    heads = text.num_attention_heads
    rope = getattr(text, "rope_parameters", None) or {}
    config = HeadConfig(
        text.hidden_size,
        heads,
        getattr(text, "num_key_value_heads", None) or heads,
        intermediate_size or text.intermediate_size,
        text.hidden_size,
        min(draft_vocab_size, text.vocab_size),
        text.vocab_size,
        default_aux_layers(text.num_hidden_layers),
        getattr(text, "head_dim", 0) or 0,
        text.rms_norm_eps,
        rope.get("rope_theta", getattr(text, "rope_theta", 10000.0)),
        verifier=str(getattr(target.config, "_name_or_path", "")),
    )
    torch.manual_seed(seed)
    embed = target.get_input_embeddings()
    return Eagle3Head(config, embed).to(device=embed.weight.device, dtype=embed.weight.dtype).eval()
