"""Load a target or draft model: preset name, local GGUF file, local directory or HF id.

Path for presets and ``.gguf`` files (``source``): the assembled GGUF (``assets``), its config and tokenizer
cached once in a small folder (``<cache>/meta``); the ``q4`` format reads the file's own blocks
(``gguf_weights``), and only the formats that start from dense weights (NF4, int8, ``none``) need its dequantized
copy: transformers' GGUF loader with ``GgufConfig(dequantize=True)``, cached as safetensors on first use
(``<cache>/dense``). Both folders are written to a temporary directory, renamed into place, stamped with each
file's size and SHA-256 and checked against the stamp at every load: by size and mtime, or every byte with
``verify=True``.
``quantization="auto"`` (the default) loads the format that measured fastest on this machine within a quality
tolerance (``format_choice``; measured at the first load, then cached).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from ..files import FileStamp, atomic_dir, check_files, sweep, write_stamp
from . import format_choice, gguf_weights
from .assets import assemble, cache_dir
from .format_load import load_weights
from .formats import DTYPES, FORMATS, Source, check_options, fallback
from .presets import PRESETS

_DONE = "ADASPEC_COMPLETE"


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode, its tokenizer, the name it was loaded from, its weight format (``formats.FORMATS``:
    the one ``quantization="auto"`` chose, or the one asked for) and whether its output head is quantized too."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    weight_format: str = "none"
    quantized_head: bool = False

    @property
    def format_label(self) -> str:
        """The weight format, "+ head" where the output head is quantized too (for reports)."""
        head = self.quantized_head and self.weight_format != "none"
        return f"{self.weight_format} + head" if head else self.weight_format


def _array_reader(parse: type) -> type:
    """``parse`` (gguf's ``GGUFReader``) slicing its memory map as a plain ``numpy.ndarray`` view of the same pages:
    the parse slices the file twice per string, and numpy's ``memmap`` subclass costs at every slice and view (a
    few times the parse's own work on a 151k-token vocabulary). Every slice goes through gguf's ``_get``, which
    switches the map to the view first. Same fields, same tensor bytes, no copy."""
    import numpy as np

    class ArrayReader(parse):
        def _get(self, *args, **kwargs):
            if type(self.data) is np.memmap:
                self.data = self.data.view(np.ndarray)
            return super()._get(*args, **kwargs)

    return ArrayReader


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Inside the block, ``gguf.GGUFReader`` parses each file once: transformers opens the GGUF file for the
    tokenizer, the config and the weights alike, and parsing its metadata (a 151k-token vocabulary, string by
    string) takes longer than dequantizing the weights. The readers are read-only memory maps, sliced as plain
    arrays (``_array_reader``)."""
    import gguf

    parse, readers = gguf.GGUFReader, {}
    array_reader = _array_reader(parse)

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = array_reader(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def _dense_from_gguf(gguf: Path, dest: Path, dtype: str) -> Path:
    """Dequantize a GGUF file into a safetensors directory ``dest`` (``files.atomic_dir``: a temporary
    folder renamed into place), stamped with every file's size and SHA-256 (``_DONE``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with atomic_dir(dest) as tmp, _gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=DTYPES[dtype], quantization_config=GgufConfig(dequantize=True)
        )
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_stamp(tmp / _DONE, [FileStamp.of(f) for f in sorted(tmp.iterdir()) if f.is_file()])
    return dest


def _meta_from_gguf(gguf: Path, dest: Path) -> Path:
    """The GGUF file's config, generation config and tokenizer (no weights) in a folder ``dest``, written and stamped
    as ``_dense_from_gguf`` writes its copy."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with atomic_dir(dest) as tmp, _gguf_parsed_once():
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config.save_pretrained(tmp)
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        (tmp / gguf_weights.INDEX).write_text(json.dumps(gguf_weights.tensor_index(gguf)))
        write_stamp(tmp / _DONE, [FileStamp.of(f) for f in sorted(tmp.iterdir()) if f.is_file()])
    return dest


def check_dense(dest: Path, full: bool = True) -> str | None:
    """Why the dense cache folder ``dest`` does not hold every file as written (``files.check_files``
    against its stamp; ``full``: every file hashed, not only those whose mtime moved), or None."""
    return check_files(dest, dest / _DONE, full)


def _dense_ok(dest: Path, full: bool = False) -> bool:
    """The dense cache ``dest`` holds every file as written (else, if it exists, say why it is rebuilt)."""
    if not dest.exists():
        return False
    problem = check_dense(dest, full)
    if problem:
        print(
            f"hf-adaspec: the dense model cache {dest} is not what was written ({problem}); rebuilding it",
            file=sys.stderr,
        )
    return problem is None


def _hub_unreachable() -> str | None:
    """Why the model hub cannot be reached (offline mode, no name resolution or connection in 3 s), or None."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname or ""
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as e:
        return f"{host} is unreachable ({e})"
    return None


def _check_name(name: str) -> None:
    """Fail at once for a name that is neither a local path nor a model in the Hugging Face cache while
    the hub cannot be reached (instead of transformers' network retries).

    Raises:
        FileNotFoundError: a path-like name (``./x``, ``/x``, ``~/x``) that does not exist.
        ValueError: an unknown id, offline; the message lists the presets.
    """
    presets = ", ".join(PRESETS)
    if Path(name).expanduser().exists():
        return
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"no model at {name!r}; give an existing folder or .gguf file, or a preset: {presets}")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    reason = _hub_unreachable()
    if reason:
        raise ValueError(
            f"{name!r} is not a preset ({presets}), a local path or a model in the Hugging Face "
            f"cache, and the hub cannot be reached ({reason}); use a preset or a local path"
        )


def dense_dir(name_or_path: str, dtype: str) -> Path | None:
    """Where the dequantized copy of a preset or ``.gguf`` file is cached (it may not exist); None for other
    sources."""
    if name_or_path in PRESETS:
        return cache_dir() / "dense" / f"{name_or_path}-{dtype}"
    if name_or_path.endswith(".gguf"):
        return cache_dir() / "dense" / f"{Path(name_or_path).expanduser().resolve().stem}-{dtype}"
    return None


def source(name_or_path: str, dtype: str = "bfloat16", verify: bool = False) -> Source:
    """Where ``name_or_path`` loads from: a preset or ``.gguf`` file as its GGUF file (assembled for a preset) with
    its config and tokenizer folder (written on first use), and its dense copy made on demand (``resolve``); any
    other name as itself. Cached entries failing their stamp (by size and mtime, or with ``verify`` by every file's
    SHA-256) are made again; temporaries of killed conversions are removed.

    Raises:
        AssetError: a preset's model part is missing or fails its hash (names the pip command).
        FileNotFoundError, ValueError: as ``_check_name`` (no such path; unknown id while offline).
    """
    for folder in ("dense", "meta"):
        sweep(cache_dir() / folder)
    if name_or_path in PRESETS:
        gguf, stem = assemble(PRESETS[name_or_path].asset, verify=verify), name_or_path
    elif name_or_path.endswith(".gguf"):
        gguf = Path(name_or_path).expanduser().resolve()
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf}")
        stem = gguf.stem
    else:
        _check_name(name_or_path)
        return Source(name_or_path)
    meta, dense = cache_dir() / "meta" / stem, dense_dir(name_or_path, dtype)

    def make_meta() -> str:
        return str(meta if _dense_ok(meta, verify) else _meta_from_gguf(gguf, meta))

    def make_dense() -> str:
        return str(dense if _dense_ok(dense, verify) else _dense_from_gguf(gguf, dense, dtype))

    return Source(gguf=gguf, meta_path=make_meta, dense_path=make_dense, has_dense=dense.exists())


def resolve(name_or_path: str, dtype: str = "bfloat16", verify: bool = False) -> str:
    """A directory or HF id that ``from_pretrained`` can load with dense weights: presets and ``.gguf`` files are
    dequantized into the cache first (``source``). Raises as ``source``."""
    return source(name_or_path, dtype, verify).dense()


def load(
    name_or_path: str,
    quantization: str = "auto",
    dtype: str = "bfloat16",
    device: str = "cpu",
    quantize_lm_head: bool = False,
    verify: bool = False,
    log: Callable[[str], None] | None = None,
) -> LoadedModel:
    """Load a causal LM and tokenizer. ``quantization``: "auto" (the fastest weight format on this machine
    within the quality tolerance, ``format_choice``: measured at the first load, which takes seconds to
    minutes, with a progress line to stderr as each format starts, then cached; ``log`` gets its one-line
    report, default stderr) or a format of ``formats.FORMATS``
    (nf4 | int8 | q4 | none | int4 | int4-torchao | gemlite; a GPU format whose kernel or library is missing
    here loads NF4, with one line to ``log`` naming what is missing). ``dtype``: the weight/compute dtype.
    ``quantize_lm_head`` also quantizes the output head (kept dense by default): worth it for a draft model, whose
    output head over the whole vocabulary is a large share of its 1-token forward (docs/experiments.md, row "NF4
    output head for the draft"); without it, "auto" measures the chosen format with its head quantized too and
    loads that where it is faster within the quality tolerance (``format_rules.keep_head``). ``verify``: hash
    every file of the cache entries used (dense copy, assembled GGUF) against its stamp instead of trusting an
    unchanged size and mtime (``hf-adaspec check-files`` checks the whole cache); an entry that fails is rebuilt.

    Raises:
        ValueError: unknown quantization or dtype, a format not for ``device``; an unknown model id while the
            hub is unreachable; "auto" when no format loads (each one's error named).
        ImportError: an explicit format whose library is not installed.
        FileNotFoundError: a path that does not exist.
        AssetError: a preset's model part is missing or fails its hash (names the pip command).
    """
    check_options(quantization, dtype)
    from transformers import AutoTokenizer

    copy_dtype = "float32" if dtype == "float32" else "bfloat16"
    origin = source(name_or_path, copy_dtype, verify)
    dense = dense_dir(name_or_path, copy_dtype)
    had_dense = dense is not None and dense.exists()
    tokenizer = AutoTokenizer.from_pretrained(origin.dense() if had_dense else origin.meta())
    if quantization == "auto":
        choice, model = format_choice.choose(
            origin, name_or_path, tokenizer, dtype, device, quantize_lm_head, progress=_stderr
        )
        (log or _stderr)(choice.line(name_or_path))
        quantization, quantize_lm_head = choice.chosen, quantize_lm_head or choice.head
    else:
        model = None
        quantization, why = fallback(quantization, device)  # a missing kernel: one line, NF4 loaded
        if why is not None:
            (log or _stderr)(why)
    if model is None:
        model = load_weights(origin, name_or_path, quantization, dtype, device, quantize_lm_head)
    if dense is not None and not had_dense and FORMATS[quantization].reads_gguf and dense.exists():
        shutil.rmtree(dense, ignore_errors=True)  # made for the probe only: the chosen format reads the GGUF file
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name_or_path, weight_format=quantization, quantized_head=quantize_lm_head
    )


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)
