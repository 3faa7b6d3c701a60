"""A preallocated KV cache whose narrow forwards run as captured graphs (a CUDA graph on a GPU).

Design: an ``Arena`` per (model, role) holds, per layer, keys and values for B_cap rows × L_cap columns at
fixed addresses (B_cap a power of two, L_cap from ``arena_sizes.capacity_for``), a row mask [B_cap, L_cap] on the device
and, per forward width n ≤ ``graph_width`` (1 … k_max + 1: a draft token, a verification), one recording
whose static inputs are the token ids and RoPE positions [B_cap, n] and the columns it writes [n]; the 4-D
attention mask is built inside the recording from the row mask (a column is visible to block column i when
it is a token of the row at or before i, or i itself, so no query row is fully masked). Recordings are made
at a width's first use (the capture time is recorded in ``Arena.records``; on a GPU as a request opens the
arena, below) and reused by later requests of the same sizes; a width whose replay measures no faster than
its eager forward runs eagerly. Wider forwards (a prompt) run eagerly on the same arena. On a GPU
(``Arena.pad``) a block runs padded to the next of the bucket widths 1, 2, 3, 5, 9, …, graph_width
(``run_width``): each recording costs a capture, and a replay's cost grows little between buckets there, so a
few recordings serve every verification and catch-up width (as vLLM buckets batch sizes); the padding columns
are masked from the real ones and their outputs dropped. Such an arena records its buckets when a request
opens it (``Arena.prime``), so a request's first speculative step, or a draft's first use late in a request,
pays no capture: the recordings cost the first request that opens an arena. On a CPU a forward's cost grows
with its width, so blocks run at their own width. A draft head's keys and values are an arena too, of one
layer, whose one recording is the head's drafted column (``head_kv``).

``StaticStore`` is one request's view of an arena, behind ``RaggedCache`` (which keeps the hole mask and the
positions on the CPU, as for the dynamic cache): which arena row each batch row is (a row that leaves the
batch keeps its slot, masked out) and how many columns are held. Rolling back shortens the held columns
(later ones stay masked until overwritten). A block that would run past L_cap first compacts every row's
tokens to the left; if that is not enough the request moves to an arena twice as wide. One request per
(model, role) at a time: a later request takes the arena over.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import graphs, hf_compat
from .arena_sizes import run_width, width_buckets
from .graphs import Capture, timed_ms

ARENAS_PER_ROLE = 3  # arenas kept per (model, role), least recently used first out
REPLAY_TIMINGS = 3  # a recording's replay is timed this many times (median) where the arena chooses by time
PAD_DEVICES = frozenset({"cuda"})  # device types whose arenas pad blocks to bucket widths and record them at opening


def block_forward(
    model: torch.nn.Module,
    ids: torch.Tensor,
    positions: torch.Tensor,
    columns: torch.Tensor,
    cache: object,
    rowmask: torch.Tensor,
    column_positions: torch.Tensor,
    column_index: torch.Tensor,
    keep: int,
    layers: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of a block ids [B, n] (RoPE ``positions`` [B, n]) written at ``columns`` [n] of an arena
    (``cache``; ``column_positions`` [B, L], each column's token position, takes the block's), the 4-D mask
    [B, 1, n, L] built from the row mask [B, L]: column j is visible to block column i when it is a token of the
    row at or before i (``column_index`` [L] = 0 … L − 1), or i itself; windowed layers see only the columns
    their window spans in token positions (``hf_compat.layer_masks``)."""
    column_positions.index_copy_(1, columns, positions)
    seen = column_index[None, :] <= columns[:, None]  # [n, L]
    own = column_index[None, :] == columns[:, None]  # [n, L]
    visible = (rowmask[:, None, None, :] & seen[None, None]) | own[None, None]  # [B, 1, n, L]
    mask = hf_compat.layer_masks(model, visible, positions, column_positions)
    return hf_compat.raw_forward(model, ids, cache, keep, mask, positions, layers)


@functools.cache
def _compiled_block():
    return torch.compile(block_forward)


@dataclass(frozen=True)
class CaptureRecord:
    """One recording: the arena's rows and columns, its width n and feature layers, whether it went through
    ``torch.compile``, what capturing took (ms; the warm-up runs and any compilation included) and the eager
    forward's and the replay's ms measured then (None where the arena does not choose by time: neither is
    run), whether the replay was kept, and the error of a capture that failed (``error``; not kept, the step
    runs eagerly for the rest of the process: ``graphs.remember_failure``)."""

    batch: int
    capacity: int
    width: int
    layers: tuple[int, ...]
    compiled: bool
    capture_ms: float
    eager_ms: float | None
    replay_ms: float | None
    kept: bool
    error: str | None = None


def keep_compiled(plain: CaptureRecord, compiled: CaptureRecord) -> bool:
    """Whether a width recorded both ways replays its compiled recording: that one was kept (its replay beat the
    eager forward) and its replay measures faster than the plain recording's, or the plain one was not kept."""
    return compiled.kept and (not plain.kept or compiled.replay_ms < plain.replay_ms)


@dataclass
class _Inputs:
    """One width's inputs: ids and positions [B_cap, n] long, the columns written [n] long, and the
    transformers cache that writes at them."""

    ids: torch.Tensor
    positions: torch.Tensor
    columns: torch.Tensor
    cache: object


@dataclass
class _Recording:
    captured: object
    out: tuple


KVShape = tuple[int, int, int, torch.dtype]  # (layers, key/value heads, head dim, dtype)


class Arena:
    """Preallocated keys/values [B_cap, H_kv, L_cap, D] per layer of one model, its row mask, and its
    recordings per (width, feature layers); ``pad``: blocks run padded to bucket widths (``arena_sizes.run_width``),
    recorded by ``prime``. ``shape``: the keys' and values' ``KVShape`` (None: the transformers model's,
    ``hf_compat.kv_shape``; a draft head gives its own, ``head_kv``); ``compiled``: the widths recorded through
    ``torch.compile`` (``arenas.ModelArenas.compile``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: int,
        capacity: int,
        capture: Capture,
        choose_by_time: bool,
        pad: bool = False,
        shape: KVShape | None = None,
        compiled: frozenset[int] = frozenset(),
    ) -> None:
        layers, heads, dim, dtype = shape or hf_compat.kv_shape(model)
        self.device, self.batch, self.capacity, self.owner = model.device, batch, capacity, weakref.ref(model)
        shape = (batch, heads, capacity, dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
        self.rowmask = torch.zeros(batch, capacity, dtype=torch.bool, device=self.device)
        self.positions = torch.zeros(batch, capacity, dtype=torch.long, device=self.device)  # [B_cap, L_cap]
        self.column_index = torch.arange(capacity, device=self.device)
        self.capture, self.choose_by_time, self.pad, self.compiled = capture, choose_by_time, pad, compiled
        self.inputs: dict[tuple[int, tuple[int, ...]], object] = {}  # per key: its recording's static inputs
        self.recordings: dict[tuple[int, tuple[int, ...]], _Recording | None] = {}
        self.records: list[CaptureRecord] = []

    def _new_inputs(self, n: int) -> _Inputs:
        ids = torch.zeros(self.batch, n, dtype=torch.long, device=self.device)
        columns = torch.zeros(n, dtype=torch.long, device=self.device)
        return _Inputs(ids, torch.zeros_like(ids), columns, hf_compat.column_cache(self.keys, self.values, columns))

    def _step(
        self, model: torch.nn.Module, inputs: _Inputs, keep: int, layers: tuple[int, ...], compiled: bool = False
    ) -> tuple:
        forward = _compiled_block() if compiled else block_forward
        return forward(
            model,
            inputs.ids,
            inputs.positions,
            inputs.columns,
            inputs.cache,
            self.rowmask,
            self.positions,
            self.column_index,
            keep,
            layers,
        )

    @torch.no_grad()
    def prime(self, model: torch.nn.Module, graph_width: int, layers: tuple[int, ...]) -> None:
        """Record the bucket widths up to ``graph_width`` (``width_buckets``, with feature ``layers``) where not
        yet recorded, on token 0 at columns 0 …, the row mask empty: only while no request holds tokens here
        (a request opening the arena, before a seed is copied in)."""
        self.rowmask.zero_()
        for width in width_buckets(graph_width):
            key = (width, layers)
            if key not in self.recordings and width <= self.capacity:
                inputs = self.inputs.setdefault(key, self._new_inputs(width))
                inputs.columns.copy_(torch.arange(width))
                inputs.positions.copy_(torch.arange(width).expand_as(inputs.positions))
                self._record(model, inputs, key)

    @torch.no_grad()
    def run(
        self,
        model: torch.nn.Module,
        slots: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        start: int,
        keep: int,
        layers: tuple[int, ...],
        graph_width: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write the block tokens [b, n] (positions [b, n]; the batch rows' masks [b, start + n]) at columns
        start … start + n − 1 of arena rows ``slots`` [b] (on the device) → logits [b, keep, V] and features
        [b, n, F] (None without ``layers``) in the model's dtype, on the device. A padded block (``run_width``)
        also writes columns start + n … start + width − 1, which stay masked until overwritten."""
        n = tokens.shape[1]
        width = run_width(n, start, graph_width, self.capacity, self.pad)
        key, recorded = (width, layers), width <= graph_width
        if recorded and key not in self.inputs:
            self.inputs[key] = self._new_inputs(width)
        inputs = self.inputs[key] if recorded else self._new_inputs(width)
        if width > n:  # padding columns: token 0, positions following the block's
            tokens = torch.nn.functional.pad(tokens, (0, width - n))  # [b, width]
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, width - n + 1)], dim=1)
        for static, given in ((inputs.ids, tokens), (inputs.positions, positions)):
            static.zero_()
            static.index_copy_(0, slots, given.to(self.device))
        inputs.columns.copy_(torch.arange(start, start + width))
        self.rowmask.zero_()
        self.rowmask[slots, : start + n] = mask.to(self.device, torch.bool)
        if not recorded:
            logits, features = self._step(model, inputs, keep, layers)
            return logits[slots], None if features is None else features[slots]
        if key not in self.recordings:
            self._record(model, inputs, key)
        recording = self.recordings[key]
        if recording is None:
            logits, features = self._step(model, inputs, width, layers)
        else:
            recording.captured.replay()
            logits, features = recording.out
        return logits[slots, n - keep : n], None if features is None else features[slots, :n]

    def _record(self, model: torch.nn.Module, inputs: _Inputs, key: tuple[int, tuple[int, ...]]) -> _Recording | None:
        """Record width ``key``'s step on the inputs it is about to run (the warm-up and the capture write the
        same keys and values at the same columns). With ``choose_by_time`` the eager forward is timed too
        (``record``); without it (a CPU's re-run stand-in) no extra forward runs and the recording is kept. A width
        in ``compiled`` is recorded plainly and after ``torch.compile`` where the arena chooses by time, and
        the faster replay is kept (compiling is kept only where it measures faster); elsewhere compiled only."""
        ref, (n, layers) = weakref.ref(model), key
        compiled = n in self.compiled

        def fn(through_compile: bool = compiled) -> tuple:
            return self._step(ref(), inputs, n, layers, through_compile)

        eager = (lambda: self._step(model, inputs, n, layers)) if self.choose_by_time else None
        if not (compiled and self.choose_by_time):
            return self.record(key, fn, eager, compiled)
        plain = self.record(key, lambda: fn(False), eager)
        if graphs.failed(model, key):
            return None
        self.record(key, fn, eager, True)
        first, second = self.records[-2], self.records[-1]  # the plain recording's, the compiled one's
        if keep_compiled(first, second):
            self.records[-2] = dataclasses.replace(first, kept=False)
        else:
            self.records[-1] = dataclasses.replace(second, kept=False)
            self.recordings[key] = plain if first.kept else None
        return self.recordings[key]

    def record(
        self,
        key: tuple[int, tuple[int, ...]],
        fn: Callable[[], tuple],
        eager: Callable[[], object] | None = None,
        compiled: bool = False,
    ) -> _Recording | None:
        """Capture ``fn`` (a step that reads only this arena's tensors and the static inputs kept in
        ``inputs[key]``; → its outputs) as ``recordings[key]``, with what capturing took in ``records``. With
        ``eager`` (the same step run eagerly) that and one replay are timed too, and the recording is dropped
        (None: the step runs eagerly) unless its replay (median of ``REPLAY_TIMINGS``) measures faster. A capture
        that raises (or failed before in this process) leaves None too: the step runs eagerly, the error said once
        (``graphs.remember_failure``), and the request goes on."""
        if graphs.failed(self.owner(), key):
            self.recordings[key] = None
            return None
        eager_ms = timed_ms(eager, self.device) if eager is not None else None
        made: list[tuple] = []
        try:
            capture_ms = timed_ms(lambda: made.append(self.capture(fn)), self.device)
        except Exception as e:  # noqa: BLE001 - whatever breaks a recording, the step runs eagerly instead
            error = graphs.remember_failure(self.owner(), key, f"step of width {key[0]}", e)
            self.records.append(
                CaptureRecord(
                    self.batch,
                    self.capacity,
                    key[0],
                    key[1],
                    compiled,
                    0.0,
                    None if eager_ms is None else round(eager_ms, 3),
                    None,
                    False,
                    error,
                )
            )
            self.recordings[key] = None
            return None
        captured, static_out = made[0]
        replay_ms = (
            statistics.median(timed_ms(captured.replay, self.device) for _ in range(REPLAY_TIMINGS))
            if eager is not None
            else None
        )
        kept = eager_ms is None or replay_ms < eager_ms
        self.records.append(
            CaptureRecord(
                self.batch,
                self.capacity,
                key[0],
                key[1],
                compiled,
                round(capture_ms, 2),
                None if eager_ms is None else round(eager_ms, 3),
                None if replay_ms is None else round(replay_ms, 3),
                kept,
            )
        )
        self.recordings[key] = _Recording(captured, static_out) if kept else None
        return self.recordings[key]

    @torch.no_grad()
    def gather(self, slots: torch.Tensor, order: torch.Tensor) -> None:
        """Move each slot's columns so that its new column j holds its old column order[i, j] ([b, W] long on
        the device), for every layer."""
        for tensor in (*self.keys, *self.values):
            rows = tensor[slots]  # [b, H, L, D]
            index = order[:, None, :, None].expand(-1, rows.shape[1], -1, rows.shape[3])
            tensor[slots, :, : order.shape[1]] = rows.gather(2, index)
        self.positions[slots, : order.shape[1]] = self.positions[slots].gather(1, order)
