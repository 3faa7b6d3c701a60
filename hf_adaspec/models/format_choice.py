"""``quantization="auto"``: load the weight format that runs fastest on this machine, within a quality tolerance.

Design (issue 44): which format is fastest depends on the processor (``formats``), so it is measured, never
read from CPU flags. At the first load of a model on a machine every format in ``formats.PROBED`` made for the
device (``formats.probed_for``) whose kernel is there (``formats.missing_kernel``) and that loads is timed: the
median latency of a forward over 1 token and over k + 1 = ``PROBE_K`` + 1 tokens on a ``PROBE_CONTEXT``-token
cache (a plain step and a verification; ``format_probe``). Its quality is measured beside it (``format_quality``: top-1 agreement
with the dense model's greedy tokens, teacher-forced, and the first divergence; the dense model is the reference
and is not scored against itself). From a GGUF file whose blocks a format reads itself (``q4`` on a CPU), the
formats that would requantize the file's dequantized weights (NF4) are not tried once that format has loaded: they
run another model than the file's and need its dense copy on disk. A format is eligible when its top-1 agreement is at most
``QUALITY_TOLERANCE`` below NF4's (or the best quantized format's where NF4 does not load); the eligible
format with the least ``score`` (a plain step's ms plus a verification's ms per verified token) is chosen, except
that NF4 stays unless that score is ``SWITCH_MARGIN`` below NF4's. Unless the caller quantizes the output head
itself, the chosen format is then measured once more with its output head quantized too (the head over the whole
vocabulary is a large share of a small model's step), and that variant is loaded when it is eligible and its
score is ``SWITCH_MARGIN`` below the dense head's (``keep_head``).
The choice and every measurement are cached under ``<cache>/formats/<key>.json`` (atomic, with a digest) per
model, dtype, device, processor, torch's thread count and kernel level and library versions; a later load reads
it and loads the chosen format only.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .. import machine
from ..files import read_json_verified, write_json_verified
from ..kernels import q4
from .assets import cache_dir
from .format_probe import PROBE_CONTEXT, PROBE_K, FormatMeasure, Timer, forward_ms, measure_format, rewarm, score
from .format_quality import dense_reference
from .formats import FORMATS, PROBED, Source, load_weights, missing_kernel, probed_for

QUALITY_TOLERANCE = 0.02  # eligible: top-1 agreement ≥ NF4's − this
SWITCH_MARGIN = 0.05  # another format replaces an eligible NF4 only when its score is this share below NF4's
QUALITY_TOKENS = 64  # dense greedy tokens per prompt in the quality check of ``auto``
SCHEMA = 5  # 2: the score of a plain step plus a verification per token; 3: NF4 kept within SWITCH_MARGIN;
# 4: the chosen format's quantized-head variant measured too; 5: NF4 not tried beside a format reading the GGUF file


@dataclass(frozen=True)
class FormatChoice:
    """The format ``auto`` chose, every format's measure, the cache file, whether it was read from it, the probe's
    seconds and whether the chosen format's output head is quantized too (``keep_head``)."""

    chosen: str
    measures: tuple[FormatMeasure, ...]
    path: Path
    cached: bool
    probe_s: float
    head: bool = False

    def line(self, name: str) -> str:
        """One line: the choice, then each format's ms over 1 / k + 1 tokens and top-1 agreement, or its error."""
        parts = [m.text() for m in self.measures]
        how = f"cached in {self.path}" if self.cached else f"probe {self.probe_s:.0f} s, cached in {self.path}"
        chosen = f"{self.chosen} + quantized head" if self.head else self.chosen
        return (f"hf-adaspec: {name}: weights {chosen} (quantization='auto'; 1/{PROBE_K + 1}-token forwards at "
                f"context {PROBE_CONTEXT}: {'; '.join(parts)}; {how})")


def eligible(measures: tuple[FormatMeasure, ...]) -> list[FormatMeasure]:
    """Loaded formats whose top-1 agreement is within ``QUALITY_TOLERANCE`` of NF4's (where NF4 did not load,
    of the best quantized format's; dense weights are always within). The bar comes from the formats with a dense
    output head; a quantized-head variant (``head``) is held to it too."""
    loaded = [m for m in measures if m.error is None and (m.top1 is not None or m.format == "none")]
    nf4 = [m.top1 for m in loaded if m.format == "nf4" and not m.head]
    quantized = [m.top1 for m in loaded if m.format != "none" and not m.head]
    bar = (nf4 or [max(quantized, default=1.0)])[0] - QUALITY_TOLERANCE
    return [m for m in loaded if (m.format == "none" and not m.head) or m.top1 >= bar]


def pick(measures: tuple[FormatMeasure, ...]) -> str:
    """The eligible format with the least ``score``; NF4 (the default before ``auto``) where it is eligible and no
    format's score is ``SWITCH_MARGIN`` below its own (a near-tie is within the probe's run-to-run spread).
    Quantized-head variants are not candidates here (``keep_head``). Raises ValueError when no format loaded (the
    message lists each one's error)."""
    ok = [m for m in eligible(measures) if not m.head]
    if not ok:
        raise ValueError("no weight format loaded: " + "; ".join(f"{m.format}: {m.error}" for m in measures))
    best = min(ok, key=lambda m: score(m.ms_1, m.ms_k))
    nf4 = next((m for m in ok if m.format == "nf4"), None)
    if nf4 is not None and score(best.ms_1, best.ms_k) > (1 - SWITCH_MARGIN) * score(nf4.ms_1, nf4.ms_k):
        return "nf4"
    return best.format


def keep_head(measures: tuple[FormatMeasure, ...], chosen: str) -> bool:
    """Whether ``chosen`` (``pick``'s format) is loaded with its output head quantized too: its ``head`` variant was
    measured, is eligible (``eligible``: the same quality bar) and its score is ``SWITCH_MARGIN`` below the
    dense head's."""
    body = next(m for m in measures if m.format == chosen and not m.head)
    variant = next((m for m in eligible(measures) if m.format == chosen and m.head), None)
    if variant is None:
        return False
    return score(variant.ms_1, variant.ms_k) <= (1 - SWITCH_MARGIN) * score(body.ms_1, body.ms_k)


def probe_key(name: str, source: str | Source, dtype: str, device: str, quantize_lm_head: bool) -> dict:
    """What a format's speed depends on: the model (as asked and where it loads from), dtype, device, whether the
    output head is quantized, the formats there are to choose from on this device (``formats.probed_for``), the
    processor, torch's thread count and CPU kernel level, the q4 kernel's source, and library versions (those
    the formats tried need too)."""
    probed = probed_for(device)  # a CPU's key is what it was before the GPU formats (issue 59)
    libraries = sorted({lib for f in probed for lib in FORMATS[f].libraries})
    where = source if isinstance(source, str) else str(source.gguf or source.path)
    return {"schema": SCHEMA, "model": name, "source": where, "dtype": dtype, "device": device,
            "quantize_lm_head": quantize_lm_head, "k": PROBE_K, "context": PROBE_CONTEXT, "formats": list(probed),
            "processor": machine.processor_name(), "threads": torch.get_num_threads(),
            "aten_cpu": torch.backends.cpu.get_cpu_capability(), "q4_kernel": q4.source_tag(),
            "versions": {**machine.versions("transformers", "bitsandbytes", *libraries), "torch": torch.__version__}}


def cache_path(key: dict) -> Path:
    """Where the choice for ``key`` is cached: ``<cache>/formats/<16 hex digits of its SHA-256>.json``."""
    import hashlib

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "formats" / f"{digest}.json"


def read_choice(path: Path, key: dict) -> FormatChoice | None:
    """The cached choice at ``path`` when it exists, passes its digest and was made for ``key``; else None."""
    try:
        doc = read_json_verified(path)
        if doc["key"] != key or doc["chosen"] not in FORMATS:
            return None
        measures = tuple(FormatMeasure(**m) for m in doc["measures"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return FormatChoice(doc["chosen"], measures, path, True, doc["probe_s"], bool(doc["head"]))


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Only errors from logger ``name`` (and its children) inside the block."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def choose(source: str | Source, name: str, tokenizer, dtype: str = "bfloat16", device: str = "cpu",
           quantize_lm_head: bool = False, timer: Timer | None = None, quality_tokens: int | None = None,
           formats: tuple[str, ...] = PROBED) -> tuple[FormatChoice, torch.nn.Module | None]:
    """The format ``auto`` loads for ``name`` (from ``source``) and, when it was measured now, that model
    already loaded (None when read from the cache: load it with ``formats.load_weights``, its output head quantized
    where ``FormatChoice.head``). Dense weights are loaded first (the quality reference), then each other format;
    only the best so far stays in memory; then, unless ``quantize_lm_head`` (the head already quantized), the
    chosen format with its head quantized (``keep_head``). ``timer``: one forward's ms (default ``forward_ms``);
    ``quality_tokens``: dense greedy tokens per prompt (default ``QUALITY_TOKENS``); ``formats``: the formats tried
    besides dense (those for another kind of device are left out; one whose kernel is missing here is recorded
    with the line naming it, not loaded).

    Raises:
        ValueError: no format loaded (each one's error named).
    """
    key = probe_key(name, source, dtype, device, quantize_lm_head)
    path = cache_path(key)
    cached = read_choice(path, key)
    if cached is not None:
        return cached, None
    start, timer = time.perf_counter(), timer or forward_ms
    dense = load_weights(source, name, "none", dtype, device, quantize_lm_head)  # the quality reference
    refs = dense_reference(dense, tokenizer, quality_tokens or QUALITY_TOKENS)
    measures: list[FormatMeasure] = []
    best_fmt, best_model = None, None
    kind = torch.device(device).type
    formats = tuple(f for f in formats if FORMATS[f].devices is None or kind in FORMATS[f].devices)
    exact = _exact_source(source)
    for fmt in ("none", *sorted((f for f in formats if f != "none"), key=_probe_order)):
        if (reason := missing_kernel(fmt, device)) is not None:  # not loaded: one line names what is missing
            measures.append(FormatMeasure(fmt, error=reason))
            continue
        if exact and not FORMATS[fmt].reads_gguf and (file_format := _read_the_file(measures)) is not None:
            measures.append(FormatMeasure(fmt, error=f"not tried: {file_format} runs the GGUF file's own blocks"))
            continue
        bound = next((score(m.ms_1, m.ms_k) for m in measures if m.format == best_fmt), None)
        load = (lambda: dense) if fmt == "none" else (lambda f=fmt: load_weights(source, name, f, dtype, device,
                                                                                   quantize_lm_head))
        with _quiet("bitsandbytes"):  # bnb int8 logs its fp16 cast at every call
            measure, model = measure_format(fmt, load, timer, refs, bound)
        dense = None
        measures.append(measure)
        if model is not None and pick(tuple(measures)) == fmt:
            best_fmt, best_model = fmt, model  # the previous best is released here
        model = None
        gc.collect()
    chosen, head = pick(tuple(measures)), False
    if not quantize_lm_head and chosen != "none":
        variant, model = _head_variant(source, name, chosen, dtype, device, timer, refs, measures,
                                       best_model if best_fmt == chosen else None)
        measures.append(variant)
        head = keep_head(tuple(measures), chosen)
        best_model = model if head else best_model
        model = None
        gc.collect()
    choice = FormatChoice(chosen, tuple(measures), path, False, round(time.perf_counter() - start, 1), head)
    write_json_verified(path, {"key": key, "chosen": choice.chosen, "head": head, "probe_s": choice.probe_s,
                               "measures": [asdict(m) for m in measures]})
    return choice, best_model if best_fmt == choice.chosen else None


def _probe_order(fmt: str) -> tuple[bool, bool]:
    """Formats that read a GGUF source's own blocks first, then NF4 (the quality bar where it is measured), then
    the rest."""
    return not FORMATS[fmt].reads_gguf, fmt != "nf4"


def _exact_source(source: str | Source) -> bool:
    """Whether ``source`` is a GGUF file whose linear layers a ``reads_gguf`` format loads from its own blocks."""
    from .gguf_weights import reads_exactly

    return isinstance(source, Source) and source.gguf is not None and reads_exactly(source.gguf, source.meta())


def _read_the_file(measures: list[FormatMeasure]) -> str | None:
    """A quantized format measured so far that reads the GGUF file's own blocks (``reads_gguf``), or None. Where one
    loaded, formats that would requantize the file's dequantized weights (NF4, int8) are not tried: they run
    another model than the file's, and they need its dense copy written to disk first."""
    return next((m.format for m in measures if m.error is None and m.format != "none"
                 and FORMATS[m.format].reads_gguf), None)


def _head_variant(source: str | Source, name: str, fmt: str, dtype: str, device: str, timer: Timer, refs,
                  measures: list[FormatMeasure],
                  body_model: torch.nn.Module | None) -> tuple[FormatMeasure, torch.nn.Module | None]:
    """``fmt`` measured with its output head quantized too (``FormatMeasure.head``), and that model. For a format
    with a ``quantize_head`` the head of ``body_model`` (``fmt`` loaded with a dense head; None: not kept) is replaced
    in place instead of loading the model again, and put back where the variant is not kept (``keep_head``); other
    formats are loaded again."""
    body = next(m for m in measures if m.format == fmt and not m.head)
    quantize_head = FORMATS[fmt].quantize_head
    if quantize_head is None or body_model is None:
        with _quiet("bitsandbytes"):
            measure, model = measure_format(fmt, lambda: load_weights(source, name, fmt, dtype, device, True), timer,
                                            refs, score(body.ms_1, body.ms_k))
        return replace(measure, head=True), model
    dense_head = body_model.get_output_embeddings()

    def swap() -> torch.nn.Module:
        body_model.set_output_embeddings(quantize_head(body_model, source))
        rewarm(body_model)  # each width runs untimed once more with the new head
        return body_model

    measure, model = measure_format(fmt, swap, timer, refs, score(body.ms_1, body.ms_k))
    measure = replace(measure, head=True)
    if model is None or not keep_head((*measures, measure), fmt):
        body_model.set_output_embeddings(dense_head)
    return measure, model
