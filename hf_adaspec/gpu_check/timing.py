"""The GPU check's clocks: tokens/s of interleaved runs (``timed_seconds``, ``tokens_per_s``), the engine's own
time per step (``forward_timer``, ``engine_overhead``) and what the arenas' recordings cost (``recordings``).

Design: a clock on a GPU must wait for queued work (``sync``) but never synchronise inside a CUDA graph capture
(``capturing``), which a synchronisation invalidates; timed requests are interleaved per prompt, their order
reversed on every other request, after an untimed warm-up round that does the one-time work, and each method
learns into a state of its own, new every round, so no timed request starts from a state that has seen its
prompt.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Iterator

import torch

from ..backend.arenas import arenas_of
from ..backend.ragged import RaggedCache
from ..engine.run import SpeculationState
from .steps import generate


def capturing(model) -> bool:
    """Whether a CUDA graph is being captured on the current stream (the model's forward is then being
    recorded, e.g. as a request opens an arena: nothing may synchronise, and no clock means anything)."""
    return model.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def sync(model) -> None:
    """Wait for the model's device (queued GPU work must not count where a clock is read); never inside a
    capture (``capturing``), where a synchronisation invalidates it."""
    if model.device.type == "cuda" and not capturing(model):
        torch.cuda.synchronize(model.device)


@contextlib.contextmanager
def forward_timer(models) -> Iterator[dict[int, list[float]]]:
    """``with forward_timer(models) as ms:`` ``ms[id(model)]`` lists the ms of each forward of each model, its
    device synchronised before and after: the engine's (every ``RaggedCache`` append, a replayed CUDA graph
    included, which no module hook sees) and transformers' own generate's (top-level module calls outside
    the engine's appends). Forwards under a graph capture (an arena recording its widths as a request opens it,
    outside any append) are neither synchronised nor timed: on 2026-11-28 this clock's synchronisation inside
    such a capture failed it."""
    ms: dict[int, list[float]] = {id(m): [] for m in models}
    start, inside = [0.0], [False]
    append = RaggedCache.append_features

    def timed_append(cache, *args, **kwargs):
        sync(cache.model)
        begin, inside[0] = time.perf_counter(), True
        try:
            return append(cache, *args, **kwargs)
        finally:
            sync(cache.model)
            inside[0] = False
            ms.setdefault(id(cache.model), []).append((time.perf_counter() - begin) * 1000.0)

    def before(module, args) -> None:
        if not inside[0] and not capturing(module):  # an append is timed whole; a capture is not a forward
            sync(module)
            start[0] = time.perf_counter()

    def after(module, args, output) -> None:
        if not inside[0] and not capturing(module):
            sync(module)
            ms[id(module)].append((time.perf_counter() - start[0]) * 1000.0)

    handles = [
        h
        for m in {id(m): m for m in models}.values()
        for h in (m.register_forward_pre_hook(before), m.register_forward_hook(after))
    ]
    RaggedCache.append_features = timed_append
    try:
        yield ms
    finally:
        RaggedCache.append_features = append
        for h in handles:
            h.remove()


def engine_overhead(target, timer: dict[int, list[float]], prompt: list[int], new: int, kwargs: dict) -> dict:
    """One greedy request at batch 1 after an untimed run of the same request (it records the steps' graphs;
    its learned state is dropped): (wall ms − all forwards' ms) per step, the wall from the engine's own clock
    (``stats.wall_ms``); for plain, per token over transformers' whole generate."""
    generate(target, prompt, new, kwargs)
    for v in timer.values():
        v.clear()
    sync(target)
    start = time.perf_counter()
    stats = getattr(generate(target, prompt, new, kwargs, SpeculationState()), "speculation", None)
    sync(target)
    wall = stats.wall_ms if stats is not None else (time.perf_counter() - start) * 1000.0
    steps = len({s.step for s in stats.steps}) if stats is not None else new
    forwards, own = sum(sum(v) for v in timer.values()), timer[id(target)][1:]  # the target's, after its prefill
    return {
        "engine_ms_per_step": round((wall - forwards) / steps, 3),
        "steps": steps,
        "wall_ms": round(wall, 1),
        "forward_ms": round(forwards, 1),
        "target_ms_per_forward": round(statistics.fmean(own), 3) if own else None,
    }


def recordings(model) -> dict:
    """The widths ``model``'s arenas recorded and what their first uses cost (ms: eager timing, capture and
    replay of each recording, summed)."""
    records = arenas_of(model).records()
    return {
        "widths": sorted({r.width for r in records}),
        "capture_ms": round(sum(r.capture_ms + (r.eager_ms or 0) + (r.replay_ms or 0) for r in records), 1),
    }


def timed_seconds(
    target, methods: dict, prompts: list[list[int]], new: int, repeats: int, targets: dict | None = None
) -> dict[str, list[list[float]]]:
    """Seconds per request, ``[method][round][prompt]``, batch 1 and greedy, over ``repeats`` timed rounds after
    an untimed warm-up round of the same requests, in which the one-time work is done (transformers'
    compilation, hf-adaspec's graph recordings of the widths a method uses). Interleaved per prompt, the
    methods' order reversed on every other request, so no method always runs after the same one. Each method
    learns across the prompts of a round into a state of its own, new every round: no timed request starts
    from a state that has seen its prompt. ``targets``: a method's own target model (default ``target``), e.g.
    the same weights with compiled recordings."""
    seconds: dict[str, list[list[float]]] = {m: [] for m in methods}
    for round_ in range(repeats + 1):
        states, times = {m: SpeculationState() for m in methods}, {m: [] for m in methods}
        for i, prompt in enumerate(prompts):
            for m in list(methods) if (round_ + i) % 2 == 0 else list(reversed(methods)):
                sync(target)
                start = time.perf_counter()
                generate((targets or {}).get(m, target), prompt, new, methods[m], states[m])
                sync(target)
                times[m].append(time.perf_counter() - start)
        for m in methods if round_ else ():
            seconds[m].append(times[m])
    return seconds


def tokens_per_s(rounds: list[list[float]], new: int) -> float:
    """Tokens/s of one method from its seconds ``[round][prompt]`` (``new`` tokens a request): the geometric
    mean over prompts of ``new`` over the prompt's median seconds."""
    prompts = range(len(rounds[0]))
    return math.exp(statistics.fmean(math.log(new / statistics.median(r[i] for r in rounds)) for i in prompts))


def timed_runs(target, methods: dict, prompts: list[list[int]], new: int, repeats: int) -> dict[str, float]:
    """Tokens/s per method (``tokens_per_s``) of ``timed_seconds``' interleaved rounds."""
    seconds = timed_seconds(target, methods, prompts, new, repeats)
    return {m: round(tokens_per_s(seconds[m], new), 2) for m in methods}
