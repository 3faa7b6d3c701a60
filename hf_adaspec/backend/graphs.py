"""Captured steps: a forward recorded once and replayed with new inputs copied into its static buffers.

On a GPU a decoding step of a small model is bound by kernel launches, not by its arithmetic or its bytes:
each of a forward's hundreds of kernels costs a launch from Python. A CUDA graph records them once and
replays them in one launch (gpt-fast, vLLM). A capture has a contract: the function reads only tensors
that stay where they are (static inputs the caller refills before each replay) and its outputs are
overwritten by the next replay. ``CudaGraphs`` captures with ``torch.cuda.CUDAGraph``: warm-up runs on a
side stream, then the capture in a memory pool of the caller's. ``Rerun`` is the stand-in on a CPU (no
graphs there): its replay calls the function again and copies the results into the first call's output
tensors, so the static-buffer discipline is exercised by the same code on any machine; ``Rerun(check=True)``
also runs that first call as a capture would have to go (``capture_check.refusing_host_reads``: no host
read, no data-dependent shape, no host tensor), so a CPU test finds what would break a capture on a GPU.

A capture that fails anyway leaves state behind in torch (2.8 to 2.13): ``capture_end`` raises at
``cudaStreamEndCapture`` before it ends the caching allocator's recording into the pool (the next capture
into that pool: "beginAllocateToPool: already recording to mempool_id") and before the CUDA generator's
capture epilogue (the next random op outside a capture: "Offset increment outside graph capture encountered
unexpectedly"). ``CudaGraphs`` ends both, releases its share of the pool and captures into a new pool from
then on, and re-raises; the caller runs that step eagerly (``failures``).
"""

from __future__ import annotations

import contextlib
import sys
import time
import weakref
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from .capture_check import refusing_host_reads

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
    arena share it, replayed one at a time on one stream). A failed capture releases what it held (module
    docstring) and re-raises its error; later captures go to a new pool."""

    def __init__(self, pool: object, warmup: int = 2) -> None:
        self.pool, self.warmup = pool, warmup

    def __call__(self, fn: Callable[[], tuple]) -> tuple[Captured, tuple]:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=self.pool)
            try:
                out = fn()
            except BaseException:
                self._abandon(graph)
                raise
            try:
                graph.capture_end()
            except Exception:
                self._release(graph)
                raise
        torch.cuda.current_stream().wait_stream(side)
        return graph, out

    def _abandon(self, graph: torch.cuda.CUDAGraph) -> None:
        """``fn`` raised inside the capture: end it (an invalidated capture's end raises too), then release."""
        try:
            graph.capture_end()
        except Exception:  # noqa: BLE001 - torch.AcceleratorError or RuntimeError, by version
            self._release(graph)
        else:  # a capture that ended cleanly releases its share of the pool and its generator states itself
            graph.reset()
            self.pool = torch.cuda.graph_pool_handle()

    def _release(self, graph: torch.cuda.CUDAGraph) -> None:
        """After ``capture_end`` raised: the allocator's recording into the pool ended and the capture's share of
        the pool released (``torch._C``: no public call does either), the CUDA generator's state replaced by a
        copy outside capture (``Generator.clone_state``), the graph reset; later captures get a new pool."""
        device = torch.cuda.current_device()
        try:
            torch._C._cuda_endAllocateToPool(device, self.pool)
        except RuntimeError:  # the recording had ended before capture_end raised (e.g. at instantiation)
            pass
        torch._C._cuda_releasePool(device, self.pool)
        generator = torch.cuda.default_generators[device]
        generator.graphsafe_set_state(generator.clone_state())
        graph.reset()
        self.pool = torch.cuda.graph_pool_handle()


class _Rerun:
    def __init__(self, fn: Callable[[], tuple], out: tuple) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        for held, new in zip(self.out, self.fn(), strict=True):
            if held is not None:
                held.copy_(new)


class Rerun:
    """The CPU stand-in for a graph capture: the first call's outputs are the static outputs, and a replay
    calls ``fn`` again and copies its results into them. ``check``: the first call runs as a capture must
    (``capture_check.refusing_host_reads``); raises ``capture_check.CaptureUnsafe`` naming an op that a CUDA
    graph could not record."""

    def __init__(self, check: bool = False) -> None:
        self.check = check

    def __call__(self, fn: Callable[[], tuple]) -> tuple[Captured, tuple]:
        with refusing_host_reads() if self.check else contextlib.nullcontext():
            out = fn()
        return _Rerun(fn, out), out


_FAILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model → {recording key: the error's line}
_SAID: set[str] = set()  # the error lines already printed in this process


def failed(owner: torch.nn.Module, key: object) -> bool:
    """Whether recording ``owner``'s step ``key`` failed earlier in this process (it runs eagerly from then on)."""
    return key in _FAILED.get(owner, {})


def remember_failure(owner: torch.nn.Module, key: object, what: str, error: BaseException) -> str:
    """Note that recording ``owner``'s step ``key`` (``what``: e.g. "the forward of width 3") raised ``error``:
    ``failed`` says so for the rest of the process, and the first failure with this error prints one line to
    stderr naming it. → the error as one line."""
    text = str(error).strip()
    line = f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"
    _FAILED.setdefault(owner, {})[key] = line
    if line not in _SAID:
        _SAID.add(line)
        print(
            f"hf-adaspec: recording {type(owner).__name__}'s {what} as a CUDA graph failed ({line}); it runs "
            "eagerly from now on",
            file=sys.stderr,
        )
    return line


def forget_failures(owner: torch.nn.Module) -> None:
    """Record ``owner``'s steps again where their captures failed (a check that made them fail on purpose)."""
    _FAILED.pop(owner, None)


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
