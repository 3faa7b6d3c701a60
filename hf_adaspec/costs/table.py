"""Measured cost table: what a verification forward and a draft token cost on this machine.

Design: the controller never assumes a cost model. At first use we time the target's forward over
n = 1..k_max+1 new tokens and the draft's 1-token forward on a fixed context (warm-up, then the median
of a few repeats, sizes interleaved), and cache the table as JSON, keyed by the model pair, dtype,
quantization, device and library versions. The curve need not be linear in n (on a CPU with NF4 it is
flat over the first few tokens), which is exactly what a fitted line would get wrong. A cost profile
(``profile``, measured by ``hf-adaspec profile`` over batch × context × new tokens) that matches the pair
takes precedence: ``CostCache`` looks for one first and calibrates only without it.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import statistics
from dataclasses import dataclass

import torch

from ..backend import hf_compat
from ..backend.arena_sizes import capacity_for
from ..backend.arenas import arenas_of
from ..backend.caches import open_cache, open_head_cache
from ..backend.graphs import timed_ms
from ..backend.stores import store_kind
from ..kernels import q4, route
from ..models.eagle3 import Eagle3Head

MAX_FORWARD_MS = 600_000.0  # a forward measured at over 10 minutes is no cost model: a corrupted or edited file


@dataclass(frozen=True)
class CostTable:
    """Median latencies in ms: ``verify_ms[n-1]`` for a target forward over n new tokens,
    ``draft_ms`` for proposing one draft token (0 for drafters that need no forward), and
    ``draft_catchup_ms`` per token the draft must ingest before drafting (its prompt, or the tokens
    of a run of plain steps)."""

    verify_ms: tuple[float, ...]
    draft_ms: float
    context: int = 128
    key: str = ""
    draft_catchup_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.verify_ms or not all(math.isfinite(t) and 0 < t <= MAX_FORWARD_MS for t in self.verify_ms):
            raise ValueError(
                f"verify_ms must be non-empty, finite and in (0, {MAX_FORWARD_MS}] ms, got {self.verify_ms}"
            )
        if not all(math.isfinite(t) and 0 <= t <= MAX_FORWARD_MS for t in (self.draft_ms, self.draft_catchup_ms)):
            raise ValueError(
                f"draft costs must be finite and in [0, {MAX_FORWARD_MS}] ms, got {self.draft_ms}, "
                f"{self.draft_catchup_ms}"
            )

    @property
    def max_tokens(self) -> int:
        """Largest measured verification width (new tokens)."""
        return len(self.verify_ms)

    def t_verify(self, n: int) -> float:
        """Latency (ms) of a target forward over n ≥ 1 new tokens; linear extrapolation past the table."""
        if n < 1:
            raise ValueError(f"a verification covers at least 1 token, got {n}")
        if n <= self.max_tokens:
            return self.verify_ms[n - 1]
        slope = (self.verify_ms[-1] - self.verify_ms[0]) / max(self.max_tokens - 1, 1)
        return self.verify_ms[-1] + max(slope, 0.0) * (n - self.max_tokens)


@dataclass(frozen=True)
class DrafterCosts:
    """Per-drafter costs in ms: one draft token, and one token ingested while catching up."""

    draft_ms: float = 0.0
    catchup_ms: float = 0.0


def pair_identity(target: torch.nn.Module, draft: torch.nn.Module | None, kv_cache: str = "auto") -> dict:
    """What a measured cost depends on: both models (name, params, dtype, quantization, device), the
    torch and transformers versions, the machine, torch's intra-op thread count and, where ``kv_cache``
    (``config.KV_CACHES``) gives the target a preallocated arena (``backend.stores.store_kind``), that its
    steps are recorded graphs ("kv": "static"), the widths recorded after ``torch.compile``
    (``api.compile_steps``) of either model ("compiled"), and where either model has q4 layers, the q4 kernel's
    source (``kernels.q4.source_tag``), the code path it takes here (``kernels.q4.path``) and the row counts from
    which its layers take the dense route (``kernels.route``; 0: never)."""
    import transformers

    compiled = {
        role: sorted(arenas_of(m).compiled)
        for role, m in (("target", target), ("draft", draft))
        if isinstance(m, torch.nn.Module) and arenas_of(m).compiled
    }
    models = {
        "target": hf_compat.model_identity(target),
        "draft": hf_compat.model_identity(draft) if draft is not None else None,
    }
    q4_layers = [m for model in (target, draft) if isinstance(model, torch.nn.Module) for m in route.layers(model)]
    return {
        **models,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        **({"kv": "static"} if store_kind(target, kv_cache) == "static" else {}),
        **({"compiled": compiled} if compiled else {}),
        **(
            {
                "q4_kernel": q4.source_tag(),
                "q4_path": q4.path(q4_layers[0].directory),
                "q4_dense_rows": sorted({m.dense_rows or 0 for m in q4_layers}),
            }
            if q4_layers
            else {}
        ),
    }


def identity_key(ident: dict) -> str:
    """16 hex digits of the SHA-256 of ``ident`` as sorted JSON: a stable file name for a cache entry."""
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def table_key(
    target: torch.nn.Module, draft: torch.nn.Module | None, n_max: int, batch: int = 1, kv_cache: str = "auto"
) -> str:
    """Stable cache key of a (target, draft) pair at a batch size on this machine and library versions."""
    ident = {
        "schema": 4,  # 4: q4 models of the Llama formula step through ``kernels.decoder`` (3: the flat loop)
        **pair_identity(target, draft, kv_cache),
        "n_max": n_max,
        **({"batch": batch} if batch != 1 else {}),
    }
    return identity_key(ident)


_CATCHUP_CHUNK = 32
DEFAULT_GRAPH_WIDTH = 9  # the widest recorded forward at the default k_max = 8: a verification of 9 tokens


class ForwardProbe:
    """Times a model's forwards over n new tokens on top of a ``context``-token cache of ``batch`` rows, kept
    where a request's would be (``kv_cache``: an arena of the capacity a request with that context gets, its
    narrow forwards replayed recordings, or a ``DynamicCache``); ``prefill``: the context from a forward over
    random tokens, else random keys and values (attention's cost does not depend on them). After each
    timed forward the cache is rolled back to the context."""

    def __init__(
        self,
        model: torch.nn.Module,
        context: int,
        n_max: int,
        batch: int = 1,
        kv_cache: str = "auto",
        prefill: bool = True,
        graph_width: int = DEFAULT_GRAPH_WIDTH,
    ) -> None:
        vocab = model.get_input_embeddings().num_embeddings
        gen = torch.Generator().manual_seed(0)
        self.model, self.context = model, context
        self.ids = torch.randint(0, vocab, (batch, context + n_max), generator=gen)
        self.cache = open_cache(model, batch, kv_cache, capacity_for(context), "probe", graph_width)
        with torch.no_grad():
            if prefill:
                self.cache.append(self.ids[:, :context], torch.ones(batch, context, dtype=torch.bool), keep=1)
            else:
                self.cache.fill_random(context)

    @torch.no_grad()
    def time_ms(self, n_new: int, keep: int | None = None) -> float:
        """Wall ms of one forward over ``n_new`` tokens keeping ``keep`` positions' logits (default all), the
        device synchronised around it; the cache is rolled back afterwards."""
        ids = self.ids[:, self.context : self.context + n_new]
        valid = torch.ones(ids.shape, dtype=torch.bool)
        elapsed = timed_ms(lambda: self.cache.append(ids, valid, n_new if keep is None else keep), self.model.device)
        self.cache.rollback(torch.full((ids.shape[0],), self.context, dtype=torch.long))
        return elapsed


class HeadProbe:
    """Times a draft head's forwards over n new entries (n = 1: one drafted column, the token just drafted
    with the head's own output, and its logits) on top of a ``context``-entry cache of random features (filled
    in chunks of 256 entries), kept where ``kv_cache`` keeps a request's (``backend.caches.open_head_cache``: on
    an arena a drafted column replays its recording); the cache is rolled back after each."""

    def __init__(self, head: Eagle3Head, context: int, batch: int = 1, kv_cache: str = "auto") -> None:
        gen = torch.Generator().manual_seed(0)
        self.head, self.batch, self.width = head, batch, 3 * head.config.target_hidden_size
        self.cache = open_head_cache(head, batch, kv_cache)
        with torch.no_grad():
            for start in range(0, context, 256):
                n = min(256, context - start)
                tokens = torch.randint(0, head.config.target_vocab_size, (batch, n), generator=gen)
                head.step(
                    tokens,
                    head.fuse(torch.randn(batch, n, self.width, generator=gen)),
                    torch.ones(batch, n, dtype=torch.bool),
                    self.cache,
                )
        self.held = self.cache.lengths.clone()

    @torch.no_grad()
    def time_ms(self, n_new: int, keep: int = 1) -> float:
        """Wall ms of one forward over ``n_new`` entries and the last one's logits (a head keeps only the last
        position's: ``keep`` is accepted for ``ForwardProbe``'s signature)."""
        tokens = torch.zeros(self.batch, n_new, dtype=torch.long)
        if n_new == 1:
            hidden = torch.zeros(self.batch, 1, self.head.config.hidden_size, device=self.head.device)
            elapsed = timed_ms(lambda: self.cache.draft_column(self.head, tokens, hidden), self.head.device)
        else:
            features = torch.zeros(self.batch, n_new, self.width)
            valid = torch.ones(self.batch, n_new, dtype=torch.bool)
            elapsed = timed_ms(
                lambda: self.head.logits(self.head.step(tokens, self.head.fuse(features), valid, self.cache)[:, -1]),
                self.head.device,
            )
        self.cache.rollback(self.held)
        return elapsed


CALIBRATED_NS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32)  # the profile's default grid of new tokens


def calibrated_ns(n_max: int) -> tuple[int, ...]:
    """The verification widths a calibration times for ``n_max``: the profile grid's n up to n_max, and
    n_max itself while the grid reaches it (wider forwards are extrapolated by ``CostTable.t_verify``)."""
    if n_max < 1:
        raise ValueError(f"n_max must be >= 1, got {n_max}")
    return tuple(sorted({n for n in CALIBRATED_NS if n <= n_max} | {min(n_max, CALIBRATED_NS[-1])}))


def _interpolated(ns: tuple[int, ...], medians: list[float]) -> tuple[float, ...]:
    """verify_ms for n = 1..ns[-1], linear between the timed widths ``ns`` (ms at each in ``medians``)."""
    out = []
    for n in range(1, ns[-1] + 1):
        i = next(j for j, m in enumerate(ns) if m >= n)
        if ns[i] == n:
            out.append(medians[i])
        else:
            w = (n - ns[i - 1]) / (ns[i] - ns[i - 1])
            out.append(medians[i - 1] + w * (medians[i] - medians[i - 1]))
    return tuple(out)


def measure(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    n_max: int,
    context: int = 128,
    repeats: int = 7,
    batch: int = 1,
    kv_cache: str = "auto",
) -> CostTable:
    """Time target forwards over the widths ``calibrated_ns(n_max)`` (new tokens; the rest interpolated),
    the draft's 1-token forward and its per-token cost of ingesting a 32-token chunk (ms, medians), each
    over ``batch`` rows (so per batch step). ``draft`` may be a draft model or an EAGLE-3 head (its
    forwards read random target features).

    One warm-up round, then ``repeats`` rounds with all sizes interleaved so drift hits them alike. At most
    13 widths up to 32 tokens are timed whatever ``n_max`` is, so a first use does not grow with ``n_max``.
    """
    ns = calibrated_ns(n_max)
    target_probe = ForwardProbe(target, context, ns[-1], batch, kv_cache, graph_width=n_max)
    draft_probe: ForwardProbe | HeadProbe | None = None
    if isinstance(draft, Eagle3Head):
        draft_probe = HeadProbe(draft, context, batch, kv_cache)
    elif draft is not None:
        draft_probe = ForwardProbe(draft, context, _CATCHUP_CHUNK, batch, kv_cache, graph_width=n_max)
    verify: list[list[float]] = [[] for _ in ns]
    drafts: list[float] = []
    catchups: list[float] = []
    for _ in range(repeats + 1):
        for i, n in enumerate(ns):
            verify[i].append(target_probe.time_ms(n))
        if draft_probe is not None:
            drafts.append(draft_probe.time_ms(1, keep=1))
            catchups.append(draft_probe.time_ms(_CATCHUP_CHUNK, keep=1) / _CATCHUP_CHUNK)
    verify_ms = _interpolated(ns, [statistics.median(v[1:]) for v in verify])
    draft_ms = statistics.median(drafts[1:]) if drafts else 0.0
    catchup_ms = statistics.median(catchups[1:]) if catchups else 0.0
    return CostTable(verify_ms, draft_ms, context, table_key(target, draft, n_max, batch, kv_cache), catchup_ms)
