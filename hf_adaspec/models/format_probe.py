"""Measuring one weight format for ``quantization="auto"`` (``format_choice``): a loaded model timed over a plain
step and a verification, and scored against the dense model's greedy tokens (``format_quality``).

Design: a forward over 1 token and over k + 1 = ``PROBE_K`` + 1 tokens on a ``PROBE_CONTEXT``-token
cache, ``PROBE_REPS`` of each interleaved (medians); a format whose first pair is already twice the best score
is timed once and not scored (it cannot be chosen). ``score``: a plain step's ms plus a verification's ms per
verified token, what ``format_choice`` ranks by.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .format_quality import agreement

PROBE_CONTEXT = 128  # tokens in the cache the timed forwards extend
PROBE_K = 5  # the verification timed covers PROBE_K + 1 tokens
PROBE_REPS = 5  # timed forwards per width (medians); a format already twice the best's time stops after 1

Timer = Callable[[torch.nn.Module, str, int], float]  # (model, format, new tokens) → one forward's ms


@dataclass(frozen=True)
class FormatMeasure:
    """One format on this machine: median ms of a forward over 1 and over k + 1 tokens at ``PROBE_CONTEXT``,
    top-1 agreement with the dense model's greedy tokens (0–1), mean first divergence (tokens), load time (s);
    quality None for dense weights (the reference) and where its first timing was twice the best's (it cannot be
    chosen; NF4's is always measured);
    or the ``error`` that kept it from loading or running (all else None). ``head``: measured with the output
    head quantized too (``keep_head``'s candidate). ``exact``: it ran the GGUF file's own blocks where dense
    weights were not loaded (``format_choice.choose``), so its quality was not scored (the file's; the kernel's
    exactness is the test suite's)."""

    format: str
    ms_1: float | None = None
    ms_k: float | None = None
    top1: float | None = None
    first_divergence: float | None = None
    load_s: float | None = None
    error: str | None = None
    head: bool = False
    exact: bool = False

    def text(self, digits: int = 0) -> str:
        """The format, its ms over 1 / k + 1 tokens (``digits`` decimals) and top-1 agreement, or why it was
        skipped."""
        label = f"{self.format} + quantized head" if self.head else self.format
        if self.error is not None:
            return f"{label} skipped ({self.error})"
        quality = (
            "the quality reference"
            if self.format == "none"
            else f"top-1 {self.top1:.3f}"
            if self.top1 is not None
            else "the GGUF file's own blocks, not scored"
            if self.exact
            else "over twice the best: quality not measured"
        )
        return f"{label} {self.ms_1:.{digits}f}/{self.ms_k:.{digits}f} ms {quality}"


def score(ms_1: float, ms_k: float) -> float:
    """ms of a plain step plus ms per token of a (k + 1)-token verification: the cost of ``adaptive``'s floor (a
    plain step, which is also a draft model's step) and of its speculative path, per token."""
    return ms_1 + ms_k / (PROBE_K + 1)


_PREFILLED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → (ids, cache, widths run once)


def forward_ms(model: torch.nn.Module, fmt: str, n: int) -> float:
    """One forward over ``n`` random tokens on a ``PROBE_CONTEXT``-token cache, in ms. The cache is prefilled at a
    model's first call and cropped back to ``PROBE_CONTEXT`` after every forward; a forward of each width
    runs once untimed first (kernel set-up)."""
    vocab = model.get_input_embeddings().num_embeddings
    with torch.inference_mode():
        if model not in _PREFILLED:
            ids = torch.randint(vocab, (1, PROBE_CONTEXT + PROBE_K + 1), generator=torch.Generator().manual_seed(0))
            ids = ids.to(model.device)
            _PREFILLED[model] = (ids, model(ids[:, :PROBE_CONTEXT], use_cache=True).past_key_values, set())
        ids, cache, warm = _PREFILLED[model]
        step = ids[:, PROBE_CONTEXT : PROBE_CONTEXT + n]  # [1, n]
        if n not in warm:
            model(step, past_key_values=cache)
            cache.crop(-n)
            warm.add(n)
        start = time.perf_counter()
        model(step, past_key_values=cache)
        elapsed = (time.perf_counter() - start) * 1e3
        cache.crop(-n)  # back to PROBE_CONTEXT
        return elapsed


def rewarm(model: torch.nn.Module) -> None:
    """At ``model``'s next ``forward_ms`` each width runs untimed once more (after a module of it was replaced)."""
    if model in _PREFILLED:
        _PREFILLED[model][2].clear()


def time_format(model: torch.nn.Module, fmt: str, timer: Timer, best_ms: float | None) -> tuple[float, float, bool]:
    """Median ms over 1 and k + 1 tokens, interleaved, ``PROBE_REPS`` each, and True; one each and False when the
    first pair's ``score`` is already twice ``best_ms`` (the best format's score: this one cannot be chosen)."""
    one, wide = [], []
    for rep in range(PROBE_REPS):
        one.append(timer(model, fmt, 1))
        wide.append(timer(model, fmt, PROBE_K + 1))
        if rep == 0 and best_ms is not None and score(one[0], wide[0]) > 2 * best_ms:
            return one[0], wide[0], False
    return statistics.median(one), statistics.median(wide), True


def measure_format(
    fmt: str, load: Callable[[], torch.nn.Module], timer: Timer, refs, best_ms: float | None
) -> tuple[FormatMeasure, torch.nn.Module | None]:
    """Load ``fmt`` with ``load`` and measure it against the dense greedy references ``refs`` (``time_format``,
    ``format_quality.agreement``; ``refs`` None: timed only; ``best_ms``: the best score so far), and that model;
    an exception while loading or running it becomes its ``error`` (and the model None)."""
    start = time.perf_counter()
    try:
        model = load()
        load_s = time.perf_counter() - start
        ms_1, ms_k, contender = time_format(model, fmt, timer, best_ms)
        # dense weights are the reference; NF4 sets the bar, so it is scored however slow
        measured = refs is not None and fmt != "none" and (contender or fmt == "nf4")
        top1, first = agreement(model, refs) if measured else (None, None)
    except Exception as e:  # noqa: BLE001 - any failure of an optional format is reported, not raised
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        return FormatMeasure(fmt, error=f"{type(e).__name__}: {reason}"), None
    quality = (round(top1, 4), round(first, 2)) if top1 is not None else (None, None)
    return FormatMeasure(fmt, round(ms_1, 2), round(ms_k, 2), *quality, round(load_s, 1)), model
