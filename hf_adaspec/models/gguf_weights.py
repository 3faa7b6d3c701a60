"""The ``q4`` format read from a GGUF file's own blocks: the file's model, not a requantization of it.

Design: transformers' GGUF loader dequantizes every tensor; requantizing that to our 4-bit layout dropped two bits
of each Q6_K tensor and moved a fifth of Q4_K's groups to another grid. Here each linear layer's GGUF tensor is
handed to the kernel as it is (``kernels.q4.from_gguf``: Q4_K, Q6_K, Q8_0, Q5_0, Q4_0 exact); other block types
are dequantized and stored as 8-bit ``q8_0`` (float tensors quantized to ``q4_k``), with a line on stderr saying
so. Everything else (embeddings, norms, biases) is dequantized into the model's dtype, as transformers does.

The model is built without initializing or copying weights: a meta-device skeleton gives the parameter names and
shapes, GGUF names are matched with gguf's own tensor-name map, and ``from_pretrained(None, state_dict=...)`` takes
the dense tensors as they are and uninitialized placeholders for the linear weights the kernel layers replace.
Two conventions of llama.cpp's converter are undone as transformers undoes them: the "llama" architecture's
query/key rows are interleaved per head (a permutation of rows, so applied to the blocks exactly), and Gemma 2/3
store norm weights plus one. Architectures whose tensors transformers splits or reshapes otherwise are refused
(``build`` returns None) and load through the dense path.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..kernels.blocks import GGUF_EXACT, quantize_q4_k, quantize_q8_0
from ..kernels.q4 import dequantize_rows, from_gguf
from ..kernels.q4_layer import Q4Linear

_PERMUTED = ("llama",)  # query/key rows interleaved per head by llama.cpp's converter
_NORM_PLUS_ONE = ("gemma2", "gemma3")  # norm weights stored as w + 1
# tensors merged, split or reshaped by transformers' GGUF loader: loaded through the dense path instead
_REFUSED = (
    "qwen2moe",
    "qwen3moe",
    "gpt-oss",
    "bloom",
    "t5",
    "t5encoder",
    "gpt2",
    "mamba",
    "nemotron",
    "lfm2",
    "minimax-m2",
)
_FLOAT = ("F32", "F16", "BF16")


INDEX = "gguf_tensors.json"  # the tensor directory, saved beside the config so a load parses no metadata


@dataclass(frozen=True)
class Tensor:
    """One GGUF tensor: its name, GGUF type name (e.g. "Q4_K") and bytes as uint8 [rows, bytes per row]."""

    name: str
    type: str
    data: np.ndarray


def tensor_index(gguf_path: Path) -> dict:
    """The file's architecture, size, mtime and tensor directory ([name, type, rows, offset, bytes] each): what
    ``read_tensors`` needs, without the vocabulary (whose parse takes longer than reading the weights)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    stat = Path(gguf_path).stat()
    tensors = [
        [t.name, t.tensor_type.name, int(np.prod(t.shape[1:])), int(t.data_offset), int(t.n_bytes)]
        for t in reader.tensors
    ]
    return {
        "architecture": str(reader.fields["general.architecture"].contents()),
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "tensors": tensors,
    }


def read_tensors(gguf_path: Path, config_dir: str) -> tuple[str, dict[str, Tensor]]:
    """(architecture, name → ``Tensor``) of a GGUF file, memory-mapped: from ``config_dir``'s ``INDEX`` where it
    describes this file (same size and mtime), else from the file's own header."""
    index_path = Path(config_dir) / INDEX
    stat = Path(gguf_path).stat()
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    if index is None or (index["size"], index["mtime_ns"]) != (stat.st_size, stat.st_mtime_ns):
        index = tensor_index(gguf_path)
    data = np.memmap(gguf_path, dtype=np.uint8, mode="r")
    tensors = {
        name: Tensor(name, kind, data[offset : offset + size].reshape(rows, -1))
        for name, kind, rows, offset, size in index["tensors"]
    }
    return index["architecture"], tensors


def _readable(arch: str) -> bool:
    """Whether ``build`` reads architecture ``arch``: one gguf names and transformers does not reshape
    (``_REFUSED``)."""
    import gguf

    return arch not in _REFUSED and arch in gguf.MODEL_ARCH_NAMES.values()


def reads_exactly(gguf_path: Path, config_dir: str) -> bool:
    """Whether ``build`` takes this file's linear layers from its own blocks (``_readable``)."""
    arch, _ = read_tensors(gguf_path, config_dir)
    return _readable(arch)


def head_rows(gguf_path: Path, config_dir: str, k: int, kernel_dir: Path) -> tuple[str, torch.Tensor]:
    """The output head's (kind, rows uint8 [V, bytes]) as ``build`` makes them with ``quantize_lm_head``: the file's
    ``output.weight``, or its token embedding where the head is tied to it; ``k``: the head's input features;
    ``kernel_dir``: where the q4 kernel is built (it converts the blocks)."""
    _, tensors = read_tensors(gguf_path, config_dir)
    tensor = tensors["output.weight"] if "output.weight" in tensors else tensors["token_embd.weight"]
    return _linear_rows(tensor, None, k, Counter(), kernel_dir)


def _row_order(name: str, n: int, config) -> np.ndarray | None:
    """The row permutation that undoes llama.cpp's query/key interleaving for tensor ``name`` of ``n`` rows (row i
    of the model is row order[i] of the file), or None for any other tensor."""
    if ".attn_q." in name:
        heads = config.num_attention_heads
    elif ".attn_k." in name:
        heads = config.num_key_value_heads
    else:
        return None
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(n)


def _hf_names(arch: str, state: dict[str, torch.Tensor], layers: int) -> dict[str, str]:
    """GGUF tensor name → the model's parameter name, by gguf's tensor-name map of ``arch``."""
    import gguf

    kind = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == arch), None)
    if kind is None:
        return {}
    names = gguf.get_tensor_name_map(kind, layers)
    out = {}
    for hf in state:
        base, _, suffix = hf.rpartition(".")
        mapped = names.get_name(base)
        if mapped is not None:
            out.setdefault(f"{mapped}.{suffix}", hf)
    return out


_CHUNK_ROWS = 256  # rows of a GGUF tensor converted to the kernel's layout at a time on the way to dense values


def _dense(
    tensor: Tensor, order: np.ndarray | None, shape: torch.Size, dtype: torch.dtype, kernel_dir: Path
) -> torch.Tensor:
    """A GGUF tensor's values in ``dtype`` and ``shape`` (rows in ``order``): exact types dequantized in C, others by
    ``gguf.quants`` (both as transformers' loader computes them)."""
    from gguf import GGMLQuantizationType, dequantize

    raw = tensor.data if order is None else tensor.data[order]
    if tensor.type in GGUF_EXACT and len(shape) == 2 and shape[1] % 32 == 0:
        out = torch.empty(shape, dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float32)
        for lo in range(0, shape[0], _CHUNK_ROWS):  # converted a chunk at a time: no copy of the whole tensor
            kind, rows = from_gguf(tensor.type, raw[lo : lo + _CHUNK_ROWS], shape[1], kernel_dir)
            dequantize_rows(kind, rows, shape[1], dtype, kernel_dir, out=out[lo : lo + _CHUNK_ROWS])
        return out.to(dtype)
    value = np.array(dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[tensor.type]))  # a copy: not the map
    return torch.from_numpy(value).reshape(shape).to(dtype)


def _linear_rows(
    tensor: Tensor, order: np.ndarray | None, k: int, notes: Counter, kernel_dir: Path
) -> tuple[str, torch.Tensor]:
    """(kind, rows) of a linear layer's GGUF tensor: its own blocks where the type is exact, else dequantized and
    stored as q8_0 (float types: quantized to q4_k); ``notes`` counts what was not exact, by GGUF type."""
    from gguf import GGMLQuantizationType, dequantize

    raw = tensor.data if order is None else tensor.data[order]  # [N, bytes]
    if tensor.type in GGUF_EXACT and k % 32 == 0:
        return from_gguf(tensor.type, raw, k, kernel_dir)
    notes[tensor.type] += 1
    value = np.array(dequantize(np.ascontiguousarray(raw), GGMLQuantizationType[tensor.type]))
    dense = torch.from_numpy(value).reshape(-1, k)
    return ("q4_k", quantize_q4_k(dense)) if tensor.type in _FLOAT else ("q8_0", quantize_q8_0(dense))


def build(
    gguf_path: Path, config_dir: str, dtype: torch.dtype, quantize_lm_head: bool, kernel_dir: Path, kernel: bool = True
) -> torch.nn.Module | None:
    """The causal LM in ``gguf_path`` (config from ``config_dir``) with every linear layer (the output head only with
    ``quantize_lm_head``) a ``Q4Linear`` on the file's blocks, the rest in ``dtype``; eval mode. ``kernel`` False:
    every tensor dequantized into ``dtype`` (the dense model transformers' loader gives, without its copy on disk).
    None where the architecture is one whose tensors transformers reshapes (``_REFUSED``) or gguf does not name.
    Raises ValueError when a parameter of the model has no tensor in the file."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    arch, tensors = read_tensors(gguf_path, config_dir)
    if not _readable(arch):
        return None
    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = skeleton.state_dict()  # meta tensors: names, shapes
    to_hf = _hf_names(arch, state, config.num_hidden_layers)
    if not to_hf:
        return None
    head = skeleton.get_output_embeddings()
    linears = {
        f"{name}.weight": name
        for name, m in skeleton.named_modules()
        if kernel and isinstance(m, torch.nn.Linear) and m.in_features % 32 == 0 and (quantize_lm_head or m is not head)
    }
    tied_head = quantize_lm_head and "output.weight" not in tensors and "lm_head.weight" in linears
    weights, parts, notes = {}, {}, Counter()
    for name, tensor in tensors.items():
        hf = to_hf.get(name)
        if hf is None:
            continue
        order = _row_order(name, tensor.data.shape[0], config) if arch in _PERMUTED else None
        shape = state[hf].shape
        if hf in linears:
            parts[linears[hf]] = _linear_rows(tensor, order, shape[1], notes, kernel_dir)
            weights[hf] = torch.empty(shape, dtype=dtype)  # never read: the layer is replaced
            continue
        value = _dense(tensor, order, shape, dtype, kernel_dir)
        weights[hf] = value - 1 if arch in _NORM_PLUS_ONE and "norm.weight" in name else value
        if tied_head and name == "token_embd.weight":
            parts["lm_head"] = _linear_rows(tensor, None, shape[1], notes, kernel_dir)
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" in state and "lm_head.weight" not in weights:
        weights["lm_head.weight"] = weights.get(to_hf.get("token_embd.weight", ""))
    missing = sorted(k for k in state if weights.get(k) is None)
    if missing:
        raise ValueError(f"{gguf_path.name}: no tensor for {', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}")
    model = type(skeleton).from_pretrained(None, config=config, state_dict=weights, dtype=dtype)
    for name, (kind, rows) in parts.items():
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        layer = getattr(owner, child)
        setattr(owner, child, Q4Linear(layer.in_features, [(kind, rows)], layer.bias, kernel_dir))
    if (Path(config_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(config_dir)
    if notes:
        converted = ", ".join(f"{n} {t}" for t, n in sorted(notes.items()))
        print(
            f"hf-adaspec: {gguf_path.name}: {converted} tensors have no exact layout in the q4 kernel: "
            "dequantized and stored as 8-bit q8_0 (float tensors: 4-bit q4_k)",
            file=sys.stderr,
        )
    return model.eval()
