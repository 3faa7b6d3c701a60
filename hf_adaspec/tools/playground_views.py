"""What the playground shows, and when: from a ``LiveSnapshot``, the k chart's and the step-time chart's
frames (pandas, long format, with every series in the colour domain from the first update), the latest
decisions table and the stats line; ``paced`` turns a run's snapshots into page updates, the charts at a
bounded rate, and accounts the page's own server-side time (``UiCost``). No Gradio here: the page lives
in ``playground``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator
from contextlib import closing
from dataclasses import dataclass

import pandas as pd

from ..engine.stats import StepRecord
from .live import (
    SOURCE_LABELS,
    LiveSnapshot,
    RunSettings,
    median_time_ratio,
    slo_attainment,
)

COLORS = dict(zip(SOURCE_LABELS.values(), ("#22c55e", "#06b6d4", "#f59e0b", "#ef4444", "#a855f7", "#9ca3af"),
                  strict=True))
DRAFTER_COLORS = {"plain": COLORS["target, plain step"], "draft_model": COLORS["draft token, accepted"],
                  "prompt_lookup": COLORS["n-gram token, accepted"], "suffix": COLORS["suffix token, accepted"]}
SERIES_COLORS = {"predicted": "#3b82f6", "realized": "#f97316", "plain decoding": COLORS["target, plain step"]}
DECISION_ROWS = 12  # latest decisions shown in the table


def _with_domain(frame: pd.DataFrame, column: str, values) -> pd.DataFrame:
    """Append one row per value of ``column`` with NaN elsewhere (not drawn). The page fixes a plot's
    colour domain from its first value, so every series must be in it from the start."""
    return pd.concat([frame, pd.DataFrame({column: pd.Series(list(values), dtype="str")})], ignore_index=True)


def k_frame(steps: list[StepRecord]) -> pd.DataFrame:
    """One row per step: step index, chosen k, drafter ("plain" for k = 0); plus the domain rows."""
    frame = pd.DataFrame({"step": pd.Series(range(1, len(steps) + 1), dtype="float64"),
                          "k": pd.Series([s.k for s in steps], dtype="float64"),
                          "drafter": pd.Series([s.drafter for s in steps], dtype="str")})
    return _with_domain(frame, "drafter", DRAFTER_COLORS)


def step_time_frame(steps: list[StepRecord], plain_ms: list[float] = ()) -> pd.DataFrame:
    """Long format, ms per step: each step's predicted time (``predicted_ms``: the step as it ran, priced
    with the controller's costs) and realized time (draft_ms + verify_ms), then the plain run's step times
    (``plain_ms``: wall time between its tokens); NaN is not drawn; plus the domain rows."""
    n, m = len(steps), len(plain_ms)
    frame = pd.DataFrame({
        "step": pd.Series([*range(1, n + 1)] * 2 + list(range(1, m + 1)), dtype="float64"),
        "series": pd.Series(["predicted"] * n + ["realized"] * n + ["plain decoding"] * m, dtype="str"),
        "ms": pd.Series([s.predicted_ms for s in steps] + [s.draft_ms + s.verify_ms for s in steps] + list(plain_ms),
                        dtype="float64"),
    })
    return _with_domain(frame, "series", SERIES_COLORS)


def decisions_frame(steps: list[StepRecord]) -> pd.DataFrame:
    """The latest decisions: drafter, k, accepted, α estimate, predicted goodput, predicted and realized ms."""
    first = max(len(steps) - DECISION_ROWS, 0)
    return pd.DataFrame(
        [(i, s.drafter, s.k, s.accepted, round(s.alpha, 3), round(s.predicted_goodput, 1), round(s.predicted_ms, 1),
          round(s.draft_ms + s.verify_ms, 1)) for i, s in enumerate(steps[first:], first + 1)],
        columns=["step", "drafter", "k", "accepted", "α", "predicted tok/s", "predicted ms", "realized ms"],
    )


def stats_markdown(snapshot: LiveSnapshot, settings: RunSettings, plain_tps: float | None, note: str = "") -> str:
    """One status line: tokens, tokens/s, TTFT, acceptance, mean accepted length, plain share, median
    realized/predicted step time, SLO, speedup; ``note`` on a second line."""
    s = snapshot.stats
    parts = [f"**{settings.method}**: {s.new_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, TTFT {s.prefill_ms:.0f} ms"]
    if settings.method != "plain":
        acceptance = "n/a" if s.acceptance_rate != s.acceptance_rate else f"{s.acceptance_rate:.2f}"
        ratio = median_time_ratio(s.steps)
        parts.append(f"acceptance {acceptance}, mean accepted length {s.mean_accepted_length:.2f}, "
                     f"plain steps {100 * s.plain_share:.0f}%")
        parts.append(f"step time realized/predicted {'n/a' if math.isnan(ratio) else f'{ratio:.2f}'} (median)")
        if settings.tpot_slo_ms is not None:
            met = slo_attainment(s.steps, settings.tpot_slo_ms)
            parts.append(f"TPOT SLO {settings.tpot_slo_ms:g} ms met by {100 * met:.0f}% of tokens")
    if plain_tps:
        parts.append(f"plain decoding {plain_tps:.1f} tokens/s → **speedup {s.tokens_per_s / plain_tps:.2f}x**")
    return " | ".join(parts) + (f"  \n{note}" if note else "")


@dataclass
class UiCost:
    """The page's own server-side work in one request: updates sent; seconds building their values; seconds
    from each yield until Gradio resumed the generator (its postprocessing, diffing and sending)."""

    updates: int = 0
    build_s: float = 0.0
    serve_s: float = 0.0

    def line(self) -> str:
        """The stats line's note: "page: N updates, X ms server-side each" (X: build + serve ms per update)."""
        each = 1000.0 * (self.build_s + self.serve_s) / self.updates if self.updates else 0.0
        return f"page: {self.updates} updates, {each:.1f} ms server-side each"


def paced(snapshots: Generator[LiveSnapshot], render, ui: UiCost, chart_interval_s: float):
    """Yield ``render(snapshot, charts)`` per snapshot, ``charts`` True at most every ``chart_interval_s``
    (s) and for the final snapshot; account the time in ``ui``; return the last snapshot. Closes
    ``snapshots`` (which ends its run) when closed early."""
    snapshot, charted = LiveSnapshot(), -math.inf
    with closing(snapshots):
        for snapshot in snapshots:
            began = time.perf_counter()
            charts = snapshot.done or began - charted >= chart_interval_s
            charted = began if charts else charted
            view = render(snapshot, charts)
            built = time.perf_counter()
            yield view
            ui.updates += 1
            ui.build_s += built - began
            ui.serve_s += time.perf_counter() - built
    return snapshot
