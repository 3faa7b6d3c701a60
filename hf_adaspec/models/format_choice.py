"""``quantization="auto"``: load the weight format that runs fastest on this machine, within a quality tolerance.

Design: which format is fastest depends on the processor (``formats``), so it is measured, never read from CPU
flags. At the first load of a model on a machine every format in ``formats.PROBED`` made for the
device (``formats.probed_for``) whose kernel is there (``formats.missing_kernel``) and that loads is timed: the
median latency of a forward over 1 token and over k + 1 = ``PROBE_K`` + 1 tokens on a ``PROBE_CONTEXT``-token
cache (a plain step and a verification; ``format_probe``). Its quality is measured beside it
(``format_quality``: top-1 agreement with the dense model's greedy tokens, teacher-forced, and the first
divergence; the dense model is the reference and is not scored against itself). A format is eligible when its
top-1 agreement is at most ``QUALITY_TOLERANCE`` below NF4's (or the best quantized format's where NF4 does not
load); the eligible format with the least ``score`` (a plain step's ms plus a verification's ms per verified
token) is chosen, except that NF4 stays unless that score is ``SWITCH_MARGIN`` below NF4's (``format_rules``).
From a GGUF file whose blocks a format reads itself here (``q4`` on a CPU; timing the others made a first load take
minutes only to rank them below it), that format alone is loaded and timed, and not scored: it runs the file's own
model (its kernel's exactness is the test suite's), dense weights would only rank last, and the formats that would
requantize the file's dequantized weights (NF4) run another model and need its dense copy on disk. Where it does not
load, the others are probed as above.
Unless the caller quantizes the output head itself, the chosen format is then measured once more with its output
head quantized too (the head over the whole vocabulary is a large share of a small model's step), and that
variant is loaded when it is eligible and its score is ``SWITCH_MARGIN`` below the dense head's (``keep_head``).
While it runs, a progress line names each stage (``choose``'s ``progress``).
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
from .format_load import load_weights
from .format_probe import PROBE_CONTEXT, PROBE_K, FormatMeasure, Timer, forward_ms, measure_format, rewarm, score
from .format_quality import dense_reference
from .format_rules import keep_head, pick
from .formats import FORMATS, PROBED, Source, missing_kernel, probed_for

QUALITY_TOKENS = 64  # dense greedy tokens per prompt in the quality check of ``auto``
SCHEMA = 6  # 2: the score of a plain step plus a verification per token; 3: NF4 kept within SWITCH_MARGIN;
# 4: the chosen format's quantized-head variant measured too; 5: NF4 not tried beside a format reading the GGUF file;
# 6: where a format reads the GGUF file here, it alone is timed (dense weights not loaded, nothing scored)


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
        return (
            f"hf-adaspec: {name}: weights {chosen} (quantization='auto'; 1/{PROBE_K + 1}-token forwards at "
            f"context {PROBE_CONTEXT}: {'; '.join(parts)}; {how})"
        )


def probe_key(name: str, source: str | Source, dtype: str, device: str, quantize_lm_head: bool) -> dict:
    """What a format's speed depends on: the model (as asked and where it loads from), dtype, device, whether the
    output head is quantized, the formats there are to choose from on this device (``formats.probed_for``), the
    processor, torch's thread count and CPU kernel level, the q4 kernel's source, and library versions (those
    the formats tried need too)."""
    probed = probed_for(device)  # a CPU's key is what it was before the GPU formats: its cached choices hold
    libraries = sorted({lib for f in probed for lib in FORMATS[f].libraries})
    where = source if isinstance(source, str) else str(source.gguf or source.path)
    return {
        "schema": SCHEMA,
        "model": name,
        "source": where,
        "dtype": dtype,
        "device": device,
        "quantize_lm_head": quantize_lm_head,
        "k": PROBE_K,
        "context": PROBE_CONTEXT,
        "formats": list(probed),
        "processor": machine.processor_name(),
        "threads": torch.get_num_threads(),
        "aten_cpu": torch.backends.cpu.get_cpu_capability(),
        "q4_kernel": q4.source_tag(),
        "versions": {**machine.versions("transformers", "bitsandbytes", *libraries), "torch": torch.__version__},
    }


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


@dataclass(frozen=True)
class _Probe:
    """What one probe loads and how it times and reports: ``source`` as ``name`` in ``dtype`` on ``device``, its head
    quantized where ``quantize_lm_head``; ``timer`` one forward's ms; ``say`` a progress line."""

    source: str | Source
    name: str
    dtype: str
    device: str
    quantize_lm_head: bool
    timer: Timer
    say: Callable[[str], None]

    def load(self, fmt: str, head: bool = False) -> torch.nn.Module:
        """Format ``fmt`` of the source, its output head quantized where ``head`` or ``quantize_lm_head``."""
        return load_weights(self.source, self.name, fmt, self.dtype, self.device, self.quantize_lm_head or head)


def choose(
    source: str | Source,
    name: str,
    tokenizer,
    dtype: str = "bfloat16",
    device: str = "cpu",
    quantize_lm_head: bool = False,
    timer: Timer | None = None,
    quality_tokens: int | None = None,
    formats: tuple[str, ...] = PROBED,
    progress: Callable[[str], None] | None = None,
) -> tuple[FormatChoice, torch.nn.Module | None]:
    """The format ``auto`` loads for ``name`` (from ``source``) and, when it was measured now, that model
    already loaded (None when read from the cache: load it with ``format_load.load_weights``, its output head quantized
    where ``FormatChoice.head``). Where ``source`` is a GGUF file whose blocks a format of ``formats`` reads itself
    on this device (``q4`` on a CPU), that format is loaded first and, once it loads, is the only one timed, not
    scored (``FormatMeasure.exact``: it runs the file's own blocks; its kernel's exactness is the test suite's), and
    neither dense weights nor the formats that would requantize the file are loaded. Otherwise dense weights are
    loaded first (the quality reference), then each other format; only the best so far stays in memory. Then,
    unless ``quantize_lm_head`` (the head already quantized), the chosen format with its head quantized
    (``keep_head``). ``timer``: one forward's ms (default ``forward_ms``); ``quality_tokens``: dense greedy tokens
    per prompt (default ``QUALITY_TOKENS``); ``formats``: the formats tried besides dense (those for another kind of
    device are left out; one whose kernel is missing here is recorded with the line naming it, not loaded);
    ``progress``: given a line as each format starts (default: none).

    Raises:
        ValueError: no format loaded (each one's error named).
    """
    key = probe_key(name, source, dtype, device, quantize_lm_head)
    path = cache_path(key)
    cached = read_choice(path, key)
    if cached is not None:
        return cached, None
    start, report = time.perf_counter(), progress or _silent
    probe = _Probe(
        source,
        name,
        dtype,
        device,
        quantize_lm_head,
        timer or forward_ms,
        lambda what: report(
            f"hf-adaspec: {name}: timing the weight formats (first load on this machine, then cached): {what}"
        ),
    )
    kind = torch.device(device).type
    formats = tuple(f for f in formats if FORMATS[f].devices is None or kind in FORMATS[f].devices)
    measures, best_model = _file_blocks(probe, formats)
    if best_model is not None:
        best_fmt, refs = measures[0].format, None
    else:
        refs, best_fmt, best_model = _every_format(probe, formats, tokenizer, quality_tokens, measures)
    chosen, head = pick(tuple(measures)), False
    if not quantize_lm_head and chosen != "none":
        probe.say(f"{chosen} + quantized head")
        variant, model = _head_variant(probe, chosen, refs, measures, best_model if best_fmt == chosen else None)
        measures.append(variant)
        head = keep_head(tuple(measures), chosen)
        best_model = model if head else best_model
        model = None
        gc.collect()
    choice = FormatChoice(chosen, tuple(measures), path, False, round(time.perf_counter() - start, 1), head)
    write_json_verified(
        path,
        {
            "key": key,
            "chosen": choice.chosen,
            "head": head,
            "probe_s": choice.probe_s,
            "measures": [asdict(m) for m in measures],
        },
    )
    return choice, best_model if best_fmt == choice.chosen else None


def _silent(line: str) -> None:
    """No progress lines (``choose``'s default)."""


def _file_blocks(probe: _Probe, formats: tuple[str, ...]) -> tuple[list[FormatMeasure], torch.nn.Module | None]:
    """Where the probe's source is a GGUF file whose blocks a format of ``formats`` reads itself with a kernel here
    (``q4`` on a CPU): that format loaded and timed, not scored (``FormatMeasure.exact``), dense weights and every
    other format recorded as not tried (they would run another model than the file's, the requantizing ones from a
    dense copy written to disk first), and its model. Where it does not load: [its error] and None (the others are
    then probed as before); elsewhere [] and None."""
    reader = next(
        (
            f
            for f in sorted(formats, key=_probe_order)
            if f != "none" and FORMATS[f].reads_gguf and missing_kernel(f, probe.device) is None
        ),
        None,
    )
    if reader is None or not _exact_source(probe.source):
        return [], None
    probe.say(f"{reader} on the GGUF file's own blocks (dense weights not loaded)")
    measure, model = measure_format(reader, lambda: probe.load(reader), probe.timer, None, None)
    if model is None:
        return [measure], None
    others = ("none", *sorted((f for f in formats if f not in ("none", reader)), key=_probe_order))
    return (
        [replace(measure, exact=True)]
        + [FormatMeasure(f, error=f"not tried: {reader} runs the GGUF file's own blocks") for f in others]
    ), model


def _every_format(
    probe: _Probe, formats: tuple[str, ...], tokenizer, quality_tokens: int | None, measures: list[FormatMeasure]
) -> tuple[list, str | None, torch.nn.Module | None]:
    """Dense weights loaded (the quality reference: their greedy tokens, ``format_quality.dense_reference``), then
    each format of ``formats`` not in ``measures`` yet (which gets each one's measure) timed and scored; only the
    best so far stays in memory. → (the dense greedy references, the best format, its model)."""
    probe.say("dense weights (the quality reference) and their greedy tokens")
    dense = probe.load("none")
    refs = dense_reference(dense, tokenizer, quality_tokens or QUALITY_TOKENS)
    best_fmt, best_model = None, None
    for fmt in ("none", *sorted((f for f in formats if f != "none"), key=_probe_order)):
        if any(m.format == fmt for m in measures):  # a reader of the file that did not load (``_file_blocks``)
            continue
        if (reason := missing_kernel(fmt, probe.device)) is not None:  # not loaded: one line names what is missing
            measures.append(FormatMeasure(fmt, error=reason))
            continue
        bound = next((score(m.ms_1, m.ms_k) for m in measures if m.format == best_fmt), None)
        # called in this iteration; dense read late, so that dense = None below frees the weights
        load = (lambda: dense) if fmt == "none" else (lambda f=fmt: probe.load(f))  # noqa: B023
        probe.say(fmt)
        with _quiet("bitsandbytes"):  # bnb int8 logs its fp16 cast at every call
            measure, model = measure_format(fmt, load, probe.timer, refs, bound)
        dense = None
        measures.append(measure)
        if model is not None and pick(tuple(measures)) == fmt:
            best_fmt, best_model = fmt, model  # the previous best is released here
        model = None
        gc.collect()
    return refs, best_fmt, best_model


def _probe_order(fmt: str) -> tuple[bool, bool]:
    """Formats that read a GGUF source's own blocks first, then NF4 (the quality bar where it is measured), then
    the rest."""
    return not FORMATS[fmt].reads_gguf, fmt != "nf4"


def _exact_source(source: str | Source) -> bool:
    """Whether ``source`` is a GGUF file whose linear layers a ``reads_gguf`` format loads from its own blocks."""
    from .gguf_weights import reads_exactly

    return isinstance(source, Source) and source.gguf is not None and reads_exactly(source.gguf, source.meta())


def _head_variant(
    probe: _Probe, fmt: str, refs, measures: list[FormatMeasure], body_model: torch.nn.Module | None
) -> tuple[FormatMeasure, torch.nn.Module | None]:
    """``fmt`` measured with its output head quantized too (``FormatMeasure.head``; ``exact`` as its body's:
    where that ran the file's own blocks, so does the head), and that model; ``refs``: the dense greedy
    references (None: not scored). For a format with a ``quantize_head`` the head of ``body_model`` (``fmt``
    loaded with a dense head; None: not kept) is replaced in place instead of loading the model again, and put back
    where the variant is not kept (``keep_head``); other formats are loaded again."""
    body = next(m for m in measures if m.format == fmt and not m.head)
    quantize_head = FORMATS[fmt].quantize_head
    if quantize_head is None or body_model is None:
        with _quiet("bitsandbytes"):
            measure, model = measure_format(
                fmt, lambda: probe.load(fmt, head=True), probe.timer, refs, score(body.ms_1, body.ms_k)
            )
        return replace(measure, head=True, exact=body.exact and measure.error is None), model
    dense_head = body_model.get_output_embeddings()

    def swap() -> torch.nn.Module:
        body_model.set_output_embeddings(quantize_head(body_model, probe.source))
        rewarm(body_model)  # each width runs untimed once more with the new head
        return body_model

    measure, model = measure_format(fmt, swap, probe.timer, refs, score(body.ms_1, body.ms_k))
    measure = replace(measure, head=True, exact=body.exact and measure.error is None)
    if model is None or not keep_head((*measures, measure), fmt):
        body_model.set_output_embeddings(dense_head)
    return measure, model
