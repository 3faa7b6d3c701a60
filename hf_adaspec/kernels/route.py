"""The dense route: from how many activation rows a q4 layer is multiplied faster through dense weights.

Design: the q4 kernel's cost grows with the rows it multiplies (each row's dot products are its own), so a long
prompt's prefill costs it about as much per token as a decode step does. Dequantizing a layer's weight (in C, a tile
at a time) and handing it to torch's matmul (``Q4Linear.dense_product``) costs a fixed dequantization plus a matmul
that, on a CPU with bfloat16 matrix instructions, grows slowly with the rows (a Xeon with AMX: the 1.5B's 512-token
prefill 8.2 s → 1.8 s). Which is faster from how many rows depends on the processor (a CPU without a fast bfloat16
matmul may never gain), so it is measured, not read from CPU flags (``measure``; ``models.route_choice`` caches the
decision per machine): ``ROWS`` from the largest down, each multiplied both ways, interleaved, medians of ``REPS``,
until the dense product is not faster (no smaller count can start the route then); the route starts at the least
count from which the dense product was faster at every larger one (``crossover``). ``ROWS`` start
at 64 so that plain steps and verifications of fewer rows (B·(k + 1) < 64; the default largest k is 8) stay on the
kernel: both multiply each row the same way, so greedy speculation still equals plain greedy, whatever the route.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator

import torch

from .q4_layer import Q4Linear

ROWS = (64, 128, 256, 512)  # activation rows at which the two products are timed
REPS = 3  # timed products per row count and way (after one untimed each)


def layers(model: torch.nn.Module) -> list[Q4Linear]:
    """``model``'s q4 layers (fused ones counted once)."""
    return [m for m in model.modules() if isinstance(m, Q4Linear)]


def largest(model: torch.nn.Module) -> Q4Linear | None:
    """``model``'s q4 layer with the most weight bytes, its output head left out unless it is the only one; None
    where it has none."""
    found = layers(model)
    head = model.get_output_embeddings()
    return max((m for m in found if m is not head), key=lambda m: m.blocks.numel(), default=next(iter(found), None))


def set_rows(model: torch.nn.Module, rows: int | None) -> None:
    """Every q4 layer of ``model`` takes the dense route from ``rows`` activation rows (None: never)."""
    for layer in layers(model):
        layer.dense_rows = rows


@contextlib.contextmanager
def kernel_only(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` with every q4 layer on the kernel inside the block, however many rows (its route restored after):
    a forward over many tokens then multiplies each row as a decode step or a verification does."""
    saved = [(layer, layer.dense_rows) for layer in layers(model)]
    try:
        for layer, _ in saved:
            layer.dense_rows = None
        yield model
    finally:
        for layer, rows in saved:
            layer.dense_rows = rows


def crossover(rows: tuple[int, ...], kernel_ms: list[float], dense_ms: list[float]) -> int | None:
    """The least of ``rows`` (ascending) from which ``dense_ms`` is below ``kernel_ms`` at it and at every larger
    count; None where the dense product is not faster at the largest."""
    start = None
    for m, kernel, dense in zip(reversed(rows), reversed(kernel_ms), reversed(dense_ms)):
        if dense >= kernel:
            break
        start = m
    return start


def measure(layer: Q4Linear, dtype: torch.dtype) -> tuple[list[int], list[float], list[float]]:
    """(rows measured, ascending; median ms of ``layer``'s product over each by the kernel; by the dense route,
    ``Q4Linear.dense_product``): ``ROWS`` from the largest down, random rows of ``dtype``, the two ways interleaved,
    ``REPS`` each after one untimed call, until the dense product is not faster (the smallest count measured)."""
    gen = torch.Generator().manual_seed(0)
    measured: list[tuple[int, float, float]] = []
    saved, layer.dense_rows = layer.dense_rows, None
    try:
        with torch.inference_mode():
            for m in reversed(ROWS):
                x = torch.randn(m, layer.in_features, generator=gen).to(dtype)  # [M, K]
                kernel, dense = _medians_ms((lambda x=x: layer(x), lambda x=x: layer.dense_product(x)))
                measured.append((m, kernel, dense))
                if dense >= kernel:
                    break
    finally:
        layer.dense_rows = saved
    rows, kernel_ms, dense_ms = zip(*reversed(measured))
    return list(rows), list(kernel_ms), list(dense_ms)


def _medians_ms(ways: tuple) -> tuple[float, float]:
    """Each of the two calls' median ms over ``REPS`` timed calls after one untimed, the two interleaved."""
    times: tuple[list[float], list[float]] = ([], [])
    for rep in range(REPS + 1):
        for way, out in zip(ways, times, strict=True):
            start = time.perf_counter()
            way()
            if rep:
                out.append((time.perf_counter() - start) * 1e3)
    return round(statistics.median(times[0]), 3), round(statistics.median(times[1]), 3)
