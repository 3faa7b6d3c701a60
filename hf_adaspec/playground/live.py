"""Live runs: one generation started elsewhere, observed step by step (what the playground shows).

Design: ``LiveRun`` starts ``model.generate`` through a ``launch`` (a new thread, or the process's main
thread through ``MainThreadRunner``) with ``speculation_callback`` (or, for plain decoding, a streamer), so
every step arrives as (StepRecord, tokens, time) on a queue; the callback only puts that tuple (the engine
never waits for the observer). ``LiveRun.update`` drains the queue into a ``LiveSnapshot`` — the text cut
into per-token pieces labelled by how each token was made, the steps so far, when each arrived, and their
``SpeculationStats`` — without waiting (the playground's feed calls it per poll); ``run_live`` iterates
a run's snapshots, waking at most once per interval. A ``threading.Event`` stops the run at the next
emitted token (a stopping criterion), and a closed run is waited for, so a stopped run frees the model.
No Gradio here: the UI lives in ``playground``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from ..config import _check_integer
from ..engine.stats import SpeculationStats, StepRecord

METHODS = ("adaptive", "prompt-lookup", "fixed", "plain")
# how a token was made (StepRecord.token_sources) → the label the playground colours
SOURCE_LABELS = {
    "draft_model": "draft token, accepted",
    "prompt_lookup": "n-gram token, accepted",
    "suffix": "suffix token, accepted",
    "correction": "target correction",
    "bonus": "target bonus",
    "plain": "target, plain step",
}
_DONE = object()


@dataclass(frozen=True)
class RunSettings:
    """One playground request. method ∈ METHODS; k: proposal length for "fixed"; tpot_slo_ms: a TPOT
    service-level objective in ms per token (None: none), reported as attainment and passed to
    generate, where the adaptive controller excludes choices predicted to break it."""

    method: str = "adaptive"
    k: int = 4
    max_new_tokens: int = 128
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    tpot_slo_ms: float | None = None

    def __post_init__(self) -> None:
        """Raises ValueError for an unknown method, a k or max_new_tokens that is not an integer >= 1 (a bool or
        a float is refused; k at most 64), or sampling settings out of range."""
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} is not one of {METHODS}")
        _check_integer("k", self.k)
        _check_integer("max_new_tokens", self.max_new_tokens)
        if not 1 <= self.k <= 64:
            raise ValueError(f"k must be in [1, 64] for the fixed method, got {self.k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.do_sample and not (self.temperature > 0 and 0 < self.top_p <= 1):
            raise ValueError("sampling needs temperature > 0 and 0 < top_p <= 1")
        if self.tpot_slo_ms is not None and self.tpot_slo_ms <= 0:
            raise ValueError(f"tpot_slo_ms must be > 0 ms, got {self.tpot_slo_ms}")


def generate_kwargs(settings: RunSettings, draft_model: torch.nn.Module | None) -> dict:
    """``model.generate`` keywords for ``settings`` (raises ValueError when the method needs a draft)."""
    kwargs: dict = {"max_new_tokens": settings.max_new_tokens, "do_sample": settings.do_sample}
    if settings.do_sample:
        kwargs.update(temperature=settings.temperature, top_p=settings.top_p)
    if settings.method == "plain":
        return kwargs
    if settings.tpot_slo_ms is not None:
        kwargs["tpot_slo_ms"] = settings.tpot_slo_ms
    if settings.method == "prompt-lookup":
        return kwargs | {"speculation": "adaptive"}
    if draft_model is None:
        raise ValueError(f"method {settings.method!r} needs a draft model; pick 'prompt-lookup' or a pair with one")
    kwargs |= {"speculation": settings.method, "assistant_model": draft_model}
    if settings.method == "fixed":
        kwargs["num_speculative_tokens"] = settings.k
    return kwargs


class _StopOnEvent(StoppingCriteria):
    """Stops generation once ``event`` is set (checked per emitted token)."""

    def __init__(self, event: threading.Event) -> None:
        self.event = event

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


class _QueueStreamer(BaseStreamer):
    """Plain decoding: forwards each generated token to the queue as a k = 0 step (the prompt is skipped)."""

    def __init__(self, events: queue.Queue) -> None:
        self.events, self.prompt_seen = events, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.events.put((None, value.reshape(-1).cpu(), time.perf_counter()))

    def end(self) -> None:
        pass


class TokenPieces:
    """Cuts streamed token ids into text pieces, one per token, decoding a short window per token.

    The piece of a token is decode(window + token) minus decode(window), the window being the
    ``context`` tokens before it (so each token costs O(context), not O(length)). A token that ends
    inside a multi-byte character gets an empty piece; its text joins the next piece.
    """

    def __init__(self, tokenizer, context: int = 8) -> None:
        self.tokenizer, self.context, self.ids, self.done = tokenizer, context, [], 0

    def add(self, token: int) -> str:
        """Append one token id; return the text it adds (possibly "")."""
        self.ids.append(token)
        start = max(0, self.done - self.context)
        before = self.tokenizer.decode(self.ids[start : self.done], skip_special_tokens=True)
        after = self.tokenizer.decode(self.ids[start:], skip_special_tokens=True)
        if after.endswith("\ufffd"):
            return ""
        if after.startswith(before):
            piece = after[len(before) :]
        else:  # decoding is not prefix-stable here: fall back to the new tokens alone
            piece = self.tokenizer.decode(self.ids[self.done :], skip_special_tokens=True)
        self.done = len(self.ids)
        return piece


@dataclass
class LiveSnapshot:
    """The run so far: (text, label) pieces, each step's record, stats; ``arrivals_ms``: when each step's
    tokens reached the observer (ms from the start; plain decoding: one entry per token, the prefill's
    first); ``done`` once generate returned."""

    pieces: list[tuple[str, str]] = field(default_factory=list)
    stats: SpeculationStats = field(default_factory=lambda: SpeculationStats(row_tokens=(0,)))
    arrivals_ms: list[float] = field(default_factory=list)
    done: bool = False

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self.pieces)

    def step_intervals_ms(self) -> list[float]:
        """Wall time between consecutive arrivals (ms), one per step after the prefill's token: for plain
        decoding, the time of each plain step as the observer saw it."""
        return [b - a for a, b in zip(self.arrivals_ms, self.arrivals_ms[1:])]


def slo_attainment(steps: list[StepRecord], tpot_slo_ms: float) -> float:
    """Share of emitted tokens whose step met the TPOT SLO (``SpeculationStats.slo_attainment``)."""
    return SpeculationStats(steps=list(steps)).slo_attainment(tpot_slo_ms)


def median_time_ratio(steps: list[StepRecord]) -> float:
    """Median over ``steps`` of realized / predicted step time: (draft_ms + verify_ms) / predicted_ms,
    skipping steps whose ``predicted_ms`` is NaN or not > 0. 1.0: the steps ran at the costs the
    controller priced them with; 2.0: twice as slow. NaN when no step was predicted."""
    ratios = sorted((s.draft_ms + s.verify_ms) / s.predicted_ms for s in steps if s.predicted_ms > 0)
    if not ratios:
        return float("nan")
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else (ratios[mid - 1] + ratios[mid]) / 2


def in_new_thread(call: Callable[[], None]) -> None:
    """Start ``call`` in a new daemon thread (``LiveRun``'s default way to run generate)."""
    threading.Thread(target=call, daemon=True).start()


class MainThreadRunner:
    """Runs submitted calls, one at a time, on the thread that calls ``serve`` — for a server, the process's
    main thread. generate runs markedly slower on a thread other than the main one here (torch 2.13 CPU,
    NF4), so the playground serves its page from other threads and generates on the main one."""

    def __init__(self) -> None:
        self.calls: queue.Queue = queue.Queue()

    def submit(self, call: Callable[[], None]) -> None:
        """Queue ``call`` (a ``LiveRun``'s ``launch``)."""
        self.calls.put(call)

    def serve(self, stop: threading.Event | None = None, poll_s: float = 0.5) -> None:
        """Run queued calls until ``stop`` is set (forever without one); each call handles its own errors."""
        while stop is None or not stop.is_set():
            try:
                call = self.calls.get(timeout=poll_s)
            except queue.Empty:
                continue
            call()


@dataclass(frozen=True)
class _Began:
    at: float  # time.perf_counter() when generate began (after the lock)


def _worker(
    model, inputs: dict, kwargs: dict, events: queue.Queue, lock: threading.Lock, finished: threading.Event
) -> None:
    """Run generate under ``lock``: put the time it began, then its exception (if any), then _DONE, on the
    queue; set ``finished``."""
    try:
        with lock:
            events.put(_Began(time.perf_counter()))
            model.generate(**inputs, **kwargs)
    except Exception as exc:  # noqa: BLE001 — handed to the observer, which re-raises it
        events.put(exc)
    finally:
        events.put(_DONE)
        finished.set()


def _apply(snapshot: LiveSnapshot, pieces: TokenPieces, record: StepRecord | None, tokens: torch.Tensor) -> None:
    """Add one step's tokens [m] to the snapshot, labelled by how each was made."""
    sources = record.token_sources() if record is not None else ("plain",) * tokens.numel()
    if record is not None:
        snapshot.stats.steps.append(record)
    for token, source in zip(tokens.tolist(), sources):
        text = pieces.add(token)
        if text:
            snapshot.pieces.append((text, SOURCE_LABELS[source]))
    snapshot.stats.row_tokens = (snapshot.stats.new_tokens + tokens.numel(),)  # one row


class LiveRun:
    """One ``generate`` call started elsewhere (``launch``: a new thread by default, or
    ``MainThreadRunner.submit``), observed without ever making it wait: ``update`` drains what arrived into
    ``snapshot`` (times from when generate began, after the lock).

    inputs: ``input_ids`` [1, T] (and ``attention_mask``). ``model`` must be ``hf_adaspec.enable``d.
    ``extra_kwargs`` go to ``generate`` as well (e.g. ``speculation_costs``). ``stop`` set → generation ends
    at the next token. ``lock`` serialises runs on one model. Raises ValueError for a method the pair cannot run.
    """

    def __init__(
        self,
        model,
        tokenizer,
        inputs: dict,
        settings: RunSettings,
        draft_model=None,
        stop: threading.Event | None = None,
        lock: threading.Lock | None = None,
        extra_kwargs: dict | None = None,
        launch: Callable[[Callable[[], None]], None] = in_new_thread,
    ) -> None:
        self.stop, lock = stop or threading.Event(), lock or threading.Lock()
        self.events: queue.Queue = queue.Queue()
        kwargs = generate_kwargs(settings, draft_model) | (extra_kwargs or {})
        kwargs["stopping_criteria"] = StoppingCriteriaList([_StopOnEvent(self.stop)])
        if "speculation" in kwargs:
            kwargs["speculation_callback"] = lambda record, tokens: self.events.put(
                (record, tokens, time.perf_counter())
            )
        else:
            kwargs["streamer"] = _QueueStreamer(self.events)
        self.finished = threading.Event()
        self.snapshot, self.pieces, self.began = LiveSnapshot(), TokenPieces(tokenizer), time.perf_counter()
        launch(lambda: _worker(model, inputs, kwargs, self.events, lock, self.finished))

    def update(self, wait_s: float | None = 0.0) -> LiveSnapshot:
        """Apply every step that arrived; wait up to ``wait_s`` seconds for the first (None: until one
        arrives). Returns ``snapshot`` (updated in place; ``done`` once generate returned). Re-raises the
        exception generate raised."""
        items = []
        try:
            items.append(self.events.get(timeout=wait_s) if wait_s != 0.0 else self.events.get_nowait())
            while True:
                items.append(self.events.get_nowait())
        except queue.Empty:
            pass
        for item in items:
            if isinstance(item, Exception):
                self.snapshot.done = True
                raise item
            if item is _DONE:
                self.snapshot.done = True
            elif isinstance(item, _Began):
                self.began = item.at
            else:
                self._arrived(*item)
        return self.snapshot

    def _arrived(self, record: StepRecord | None, tokens: torch.Tensor, at: float) -> None:
        """One step's tokens, emitted at ``at`` (perf_counter s)."""
        snapshot = self.snapshot
        if not snapshot.stats.new_tokens:
            snapshot.stats.prefill_ms = (at - self.began) * 1000.0  # TTFT
        _apply(snapshot, self.pieces, record, tokens)
        snapshot.stats.wall_ms = (at - self.began) * 1000.0
        snapshot.arrivals_ms.append(snapshot.stats.wall_ms)

    def close(self) -> None:
        """End the run if it is still going (sets ``stop``) and wait until generate has returned."""
        if not self.snapshot.done:
            self.stop.set()
        self.finished.wait()


def run_live(
    model,
    tokenizer,
    inputs: dict,
    settings: RunSettings,
    draft_model=None,
    stop: threading.Event | None = None,
    lock: threading.Lock | None = None,
    min_interval_s: float = 0.25,
    extra_kwargs: dict | None = None,
    launch: Callable[[Callable[[], None]], None] = in_new_thread,
) -> Iterator[LiveSnapshot]:
    """A ``LiveRun`` as an iterator: yield its snapshot at most every ``min_interval_s`` (s; only when
    tokens arrived) and at once when generate returns (the same object, updated in place). Arguments and
    errors as ``LiveRun``; closing the iterator early stops the run and waits for it."""
    run = LiveRun(model, tokenizer, inputs, settings, draft_model, stop, lock, extra_kwargs, launch)
    try:
        while not run.snapshot.done:
            run.update(wait_s=None)  # wake once per interval, not per token: the worker keeps the GIL
            last = time.perf_counter()
            yield run.snapshot
            if not run.snapshot.done:  # ends early when the worker does, so the final update is not delayed
                run.finished.wait(timeout=max(0.0, last + min_interval_s - time.perf_counter()))
    finally:
        run.close()
