"""Captured steps: a forward recorded once and replayed with new inputs copied into its static buffers.

On a GPU a decoding step of a small model is bound by kernel launches, not by its arithmetic or its bytes:
each of a forward's hundreds of kernels costs a launch from Python. A CUDA graph records them once and
replays them in one launch (gpt-fast, vLLM). A capture has a contract: the function reads only tensors
that stay where they are (static inputs the caller refills before each replay) and its outputs are
overwritten by the next replay. ``CudaGraphs`` captures with ``torch.cuda.CUDAGraph``: warm-up runs on a
side stream, then the capture in a memory pool of the caller's. ``Rerun`` is the stand-in on a CPU (no
graphs there): its replay calls the function again and copies the results into the first call's output
tensors, so the static-buffer discipline is exercised by the same code on any machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

T = TypeVar("T")


class Captured(Protocol):
    """A recorded step: ``replay`` runs it again on whatever its static inputs now hold."""

    def replay(self) -> None: ...


class Capture(Protocol):
    """Records ``fn`` (a function of static inputs returning a tuple of tensors, or Nones) → the recording
    and its static outputs."""

    def __call__(self, fn: Callable[[], tuple]) -> tuple[Captured, tuple]: ...


class CudaGraphs:
    """``torch.cuda.CUDAGraph`` capture: ``warmup`` runs of ``fn`` on a side stream (lazy initialisation,
    cuBLAS workspaces), then one capture into ``pool`` (``torch.cuda.graph_pool_handle()``; graphs of one
    arena share it, replayed one at a time on one stream)."""

    def __init__(self, pool: object, warmup: int = 2) -> None:
        self.pool, self.warmup = pool, warmup

    def __call__(self, fn: Callable[[], tuple]) -> tuple[Captured, tuple]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out


class _Rerun:
    def __init__(self, fn: Callable[[], tuple], out: tuple) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        for held, new in zip(self.out, self.fn(), strict=True):
            if held is not None:
                held.copy_(new)


class Rerun:
    """The CPU stand-in for a graph capture: the first call's outputs are the static outputs, and a replay
    calls ``fn`` again and copies its results into them."""

    def __call__(self, fn: Callable[[], tuple]) -> tuple[Captured, tuple]:
        out = fn()
        return _Rerun(fn, out), out


def capture_for(device: torch.device) -> Capture:
    """How steps are recorded on ``device``: CUDA graphs (a new memory pool) on a GPU, ``Rerun`` elsewhere."""
    return CudaGraphs(torch.cuda.graph_pool_handle()) if device.type == "cuda" else Rerun()


def timed_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Wall ms of one call of ``fn``, the device synchronised before and after (a GPU's queued work
    must not count, and its own work must)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if cuda:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1000.0
