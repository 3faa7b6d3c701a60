"""Measuring a cost profile: the grid, synthetic contexts, interleaved timing, the cost-curve plot.

Design: contexts come from ``hf_compat.synthetic_cache`` (random keys and values; attention's cost does
not depend on them) instead of a prefill, which at large batch × context would cost more than the
forwards it serves; each timed forward is rolled back. Per (batch, context) one cache per model, a
warm-up round, then ``repeats`` rounds with all that group's cells interleaved (order alternating
between rounds); the median of the rounds is kept and the caches are dropped before the next group.
Target cells with b·n > ``max_tokens_per_forward`` (default 64) are skipped. The default grid is
contexts 128..2048 and batch 1..16 (261 cells in 26 groups, 25 of them held out); longer contexts and
wider forwards are opt-in (``--contexts``, ``--max-tokens-per-forward``), since they make a profile much
slower to measure. Held-out cells off the grid are timed the same way and used only to score the
predictors (``profile.assemble_profile``).
"""

from __future__ import annotations

import datetime
import itertools
import os
import platform
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..backend import hf_compat
from ..files import atomic_write
from ..machine import processor_name
from ..models.eagle3 import Eagle3Head
from .predictors import CATCHUP_CHUNK, ProfileCell
from .profile import Profile, assemble_profile
from .profile_files import library_versions, profile_identity
from .table import ForwardProbe, HeadProbe

DRAFT_NEW_TOKENS = (1, CATCHUP_CHUNK)
SKIP_RULE = "target cells with batch * new_tokens > max_tokens_per_forward are not measured"
HELD_OUT_RULE = (
    "off-grid cells used only to score the predictors: contexts midway between buckets at the smallest "
    "and middle grid n, and n midway across gaps of the grid at the middle context; smallest and "
    "largest batch; draft cells at the midway contexts"
)


def _check_sizes(name: str, values: tuple[int, ...]) -> None:
    if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
        raise ValueError(f"{name} must be non-empty, increasing and >= 1, got {values}")


@dataclass(frozen=True)
class ProfileGrid:
    """What to measure: new tokens n, batch sizes b, context lengths c (tokens), timed rounds per cell,
    and the largest b·n a measured target forward may have."""

    new_tokens: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 24, 32)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    contexts: tuple[int, ...] = (128, 512, 1024, 2048)
    repeats: int = 3
    max_tokens_per_forward: int = 64

    def __post_init__(self) -> None:
        for name in ("new_tokens", "batch_sizes", "contexts"):
            _check_sizes(name, getattr(self, name))
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        smallest = self.batch_sizes[-1] * self.new_tokens[0]
        if smallest > self.max_tokens_per_forward:
            raise ValueError(
                f"max_tokens_per_forward={self.max_tokens_per_forward} skips every cell at batch "
                f"{self.batch_sizes[-1]}; raise it to at least {smallest}"
            )

    def target_ns(self, batch: int) -> tuple[int, ...]:
        """The grid's n measured at ``batch`` (b·n within the limit)."""
        return tuple(n for n in self.new_tokens if batch * n <= self.max_tokens_per_forward)

    def held_out(self) -> tuple[tuple[int, int, int], ...]:
        """Off-grid target cells (b, c, n): contexts midway between buckets at the smallest and middle
        grid n, and n midway across gaps of the grid at the middle context; smallest and largest b."""
        ns, cs = self.new_tokens, self.contexts
        mid_cs = [(a + b) // 2 for a, b in itertools.pairwise(cs)]
        mid_ns = [(a + b) // 2 for a, b in itertools.pairwise(ns) if b - a > 1]
        cells = []
        for b in sorted({self.batch_sizes[0], self.batch_sizes[-1]}):
            cells += [(b, c, n) for c in mid_cs for n in sorted({ns[0], ns[len(ns) // 2]})]
            cells += [(b, cs[len(cs) // 2], n) for n in mid_ns]
        return tuple((b, c, n) for b, c, n in cells if b * n <= self.max_tokens_per_forward)


QUICK_GRID = ProfileGrid(new_tokens=(1, 2, 3, 4), batch_sizes=(1, 2), contexts=(128, 256), repeats=1)


def pair_name(target: str, draft: str) -> str:
    """Folder name of a pair under model_cards: ``qwen2.5-coder-1.5b_0.5b`` (the draft's name without
    the prefix it shares with the target's); paths and HF ids contribute their last component's stem."""
    t, d = (
        Path(name.rstrip("/").split("/")[-1]).stem if "/" in name or name.endswith(".gguf") else name
        for name in (target, draft)
    )
    cut = os.path.commonprefix([t, d]).rfind("-") + 1
    return f"{t}_{d[cut:] or d}"


@dataclass(frozen=True)
class _Job:
    """One cell to time within a (batch, context) group."""

    role: str  # "target" or "draft"
    new_tokens: int
    held_out: bool


def _plan(grid: ProfileGrid, with_draft: bool) -> dict[tuple[int, int], list[_Job]]:
    """(batch, context) → the cells timed there: the grid's, then held-out ones (draft ones at the
    held-out contexts)."""

    def draft_jobs(held: bool) -> list[_Job]:
        return [_Job("draft", n, held) for n in DRAFT_NEW_TOKENS] if with_draft else []

    plan = {
        (b, c): [_Job("target", n, False) for n in grid.target_ns(b)] + draft_jobs(False)
        for b in grid.batch_sizes
        for c in grid.contexts
    }
    for b, c, n in grid.held_out():
        plan.setdefault((b, c), []).append(_Job("target", n, True))
    for b, c in sorted({(b, c) for b, c, _ in grid.held_out() if c not in grid.contexts}):
        plan[(b, c)] += draft_jobs(True)
    return dict(sorted(plan.items()))


def _probe(model, batch: int, context: int, longest: int, kv_cache: str) -> ForwardProbe | HeadProbe:
    """``time_ms(n, keep)``: wall ms of one forward of ``model`` over n new tokens keeping ``keep`` positions'
    logits, on a synthetic ``context``-token cache of ``batch`` rows kept where ``kv_cache`` puts a request's
    (a draft head: its own probe)."""
    if isinstance(model, Eagle3Head):
        return HeadProbe(model, context, batch, kv_cache)
    return ForwardProbe(model, context, longest, batch, kv_cache, prefill=False)


def _measure_group(
    models: dict, batch: int, context: int, jobs: list[_Job], repeats: int, kv_cache: str
) -> dict[_Job, list[float]]:
    """Timed ms per job: one synthetic cache per model, a warm-up round, then ``repeats`` rounds with
    every job interleaved (order alternating between rounds). The draft keeps 1 position's logits, as
    when it drafts or catches up; the target keeps all n, as when it verifies."""
    roles = sorted({j.role for j in jobs})
    timers = {
        r: _probe(models[r], batch, context, max(j.new_tokens for j in jobs if j.role == r), kv_cache).time_ms
        for r in roles
    }
    samples: dict[_Job, list[float]] = {j: [] for j in jobs}
    for round_ in range(repeats + 1):
        for job in jobs if round_ % 2 == 0 else jobs[::-1]:
            ms = timers[job.role](job.new_tokens, job.new_tokens if job.role == "target" else 1)
            if round_:  # round 0 is the warm-up
                samples[job].append(ms)
    return samples


def measure_profile(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    grid: ProfileGrid = ProfileGrid(),
    pair: str = "",
    command: str = "",
    progress: bool = False,
    kv_cache: str = "auto",
) -> Profile:
    """Measure ``grid`` for the pair (``draft`` None: target only, for prompt lookup) and return the
    profile with fits, held-out errors and each quantity's predictor. ``progress``: a tqdm bar per group;
    ``kv_cache``: where the probes keep their caches (``config.KV_CACHES``: on a GPU by default an arena whose
    narrow forwards replay CUDA graphs, as a request's do). The models run the attention a speculative request
    runs (``hf_compat.speculative_attention``; a draft head its own)."""
    models = {"target": target, "draft": draft}
    cells: dict[str, list[ProfileCell]] = {"target": [], "draft": [], "held_out_target": [], "held_out_draft": []}
    paired = [m for m in (target, draft) if m is not None and not isinstance(m, Eagle3Head)]
    with hf_compat.speculative_attention(*(hf_compat.AttentionSwap(m) for m in paired)):
        for (b, c), jobs in tqdm(
            _plan(grid, draft is not None).items(), desc="profile (batch, context)", disable=not progress
        ):
            for job, samples in _measure_group(models, b, c, jobs, grid.repeats, kv_cache).items():
                name = ("held_out_" if job.held_out else "") + job.role
                cells[name].append(ProfileCell(b, c, job.new_tokens, statistics.median(samples), tuple(samples)))
    return assemble_profile(pair, profile_identity(target, draft, kv_cache), cells, _meta(grid, command))


def _meta(grid: ProfileGrid, command: str) -> dict:
    """Where and how a profile was measured: library versions, machine, cpu, threads, UTC time, the
    command line, and the grid with its skip and held-out rules (JSON types: lists, not tuples)."""
    grid_json = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(grid).items()}
    return {
        "versions": library_versions(),
        "machine": platform.machine(),
        "cpu": processor_name(),
        "threads": torch.get_num_threads(),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "grid": {
            **grid_json,
            "skip_rule": SKIP_RULE,
            "draft_new_tokens": list(DRAFT_NEW_TOKENS),
            "held_out_rule": HELD_OUT_RULE,
        },
    }


def plot_profile(profile: Profile, path: str | Path) -> None:
    """``cost_curves.png`` (written atomically): target ms vs new tokens, one line per batch size, at the
    middle measured context; and ms vs context at the smallest batch for a few n and the draft token.
    Dots: measured medians; lines: each quantity's chosen predictor. Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    try:
        _plot_vs_tokens(ax1, profile)
        _plot_vs_context(ax2, profile)
        fig.tight_layout()
        atomic_write(Path(path), lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)


def _plot_vs_tokens(ax, profile: Profile) -> None:
    """Target ms vs new tokens n at the middle measured context, one line per batch size."""
    cells = profile.target_cells
    contexts = sorted({c.context for c in cells})
    mid = contexts[len(contexts) // 2]
    for i, b in enumerate(sorted({c.batch for c in cells})):
        pts = sorted((c.new_tokens, c.median_ms) for c in cells if c.batch == b and c.context == mid)
        ns = range(1, pts[-1][0] + 1)
        ax.plot([n for n, _ in pts], [t for _, t in pts], "o", color=f"C{i}")
        ax.plot(ns, [profile.verify_ms(b, mid, n) for n in ns], "-", color=f"C{i}", label=f"batch {b}")
    ax.set(xlabel="new tokens n", ylabel="target forward, ms", title=f"Target at context {mid}")
    ax.legend()


def _plot_vs_context(ax, profile: Profile) -> None:
    """ms vs context at the smallest batch: the target at its smallest, middle and largest n; the draft token."""
    cells = profile.target_cells
    contexts = sorted({c.context for c in cells})
    b0 = min(c.batch for c in cells)
    xs = range(contexts[0], contexts[-1] + 1, max((contexts[-1] - contexts[0]) // 64, 1))
    ns = sorted({c.new_tokens for c in cells if c.batch == b0})
    for i, n in enumerate(sorted({ns[0], ns[len(ns) // 2], ns[-1]})):
        pts = sorted((c.context, c.median_ms) for c in cells if c.batch == b0 and c.new_tokens == n)
        ax.plot([c for c, _ in pts], [t for _, t in pts], "o", color=f"C{i}")
        ax.plot(xs, [profile.verify_ms(b0, c, n) for c in xs], "-", color=f"C{i}", label=f"target n={n}")
    if profile.draft_cells:
        ax.plot(xs, [profile.draft_ms(b0, c) for c in xs], "--", color="k", label="draft token")
    chosen = f"target: {profile.predictor('verify')}, draft: {profile.predictor('draft')}"
    ax.set(xlabel="context, tokens", ylabel="ms", title=f"Batch {b0} ({chosen})")
    ax.legend()
