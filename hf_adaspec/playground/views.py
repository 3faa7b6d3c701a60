"""What the playground's page is sent: a request's ``RunFeed`` answers each poll of the page with only what is
new since the page's cursor (token pieces with their labels, one row per step, the plain run's pieces and
step times) and the stats line; the page appends them (``page``). The feed starts plain decoding of
the same prompt once the method's run is done (for the speedup) and accounts its own server-side time
(``UiCost``). No Gradio here: the page lives in ``playground``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..engine.stats import StepRecord
from .live import (
    SOURCE_LABELS,
    LiveRun,
    LiveSnapshot,
    RunSettings,
    median_time_ratio,
    slo_attainment,
)

COLORS = dict(
    zip(SOURCE_LABELS.values(), ("#22c55e", "#06b6d4", "#f59e0b", "#ef4444", "#a855f7", "#9ca3af"), strict=True)
)
DRAFTER_COLORS = {
    "plain": COLORS["target, plain step"],
    "draft_model": COLORS["draft token, accepted"],
    "prompt_lookup": COLORS["n-gram token, accepted"],
    "suffix": COLORS["suffix token, accepted"],
}
SERIES_COLORS = {"predicted": "#3b82f6", "realized": "#f97316", "plain decoding": COLORS["target, plain step"]}
STEP_FIELDS = ("drafter", "k", "accepted", "alpha", "predicted_goodput", "predicted_ms", "realized_ms")
CURSOR_FIELDS = ("pieces", "steps", "plain_pieces", "plain_ms")


def step_row(step: StepRecord) -> list:
    """One step as the page gets it, in ``STEP_FIELDS`` order: drafter, k, accepted, α estimate, predicted
    goodput (tokens/s), predicted ms (None when not predicted), realized ms (draft_ms + verify_ms)."""
    predicted = round(step.predicted_ms, 1) if step.predicted_ms > 0 else None  # NaN and 0: not predicted
    return [
        step.drafter,
        step.k,
        step.accepted,
        round(step.alpha, 3),
        round(step.predicted_goodput, 1),
        predicted,
        round(step.draft_ms + step.verify_ms, 1),
    ]


def stats_line(snapshot: LiveSnapshot, settings: RunSettings, plain_tps: float | None, note: str = "") -> str:
    """One status line: tokens, tokens/s, TTFT, acceptance, mean accepted length, plain share, median
    realized/predicted step time, SLO, speedup; ``note`` on a second line."""
    s = snapshot.stats
    parts = [f"{settings.method}: {s.new_tokens} tokens, {s.tokens_per_s:.1f} tokens/s, TTFT {s.prefill_ms:.0f} ms"]
    if settings.method != "plain":
        acceptance = "n/a" if s.acceptance_rate != s.acceptance_rate else f"{s.acceptance_rate:.2f}"
        ratio = median_time_ratio(s.steps)
        parts.append(
            f"acceptance {acceptance}, mean accepted length {s.mean_accepted_length:.2f}, "
            f"plain steps {100 * s.plain_share:.0f}%"
        )
        parts.append(f"step time realized/predicted {'n/a' if math.isnan(ratio) else f'{ratio:.2f}'} (median)")
        if settings.tpot_slo_ms is not None:
            met = slo_attainment(s.steps, settings.tpot_slo_ms)
            parts.append(f"TPOT SLO {settings.tpot_slo_ms:g} ms met by {100 * met:.0f}% of tokens")
    if plain_tps:
        parts.append(f"plain decoding {plain_tps:.1f} tokens/s → speedup {s.tokens_per_s / plain_tps:.2f}x")
    return " | ".join(parts) + (f"\n{note}" if note else "")


@dataclass
class UiCost:
    """The page's own server-side work in one request: polls answered and seconds spent answering them."""

    updates: int = 0
    serve_s: float = 0.0

    def line(self) -> str:
        """The stats line's note: "page: N updates, X ms server-side each"."""
        each = 1000.0 * self.serve_s / self.updates if self.updates else 0.0
        return f"page: {self.updates} updates, {each:.1f} ms server-side each"


class RunFeed:
    """One request as the page polls it: ``main`` (the chosen method's ``LiveRun``), then, when
    ``start_plain`` is given, plain decoding of the same prompt for the speedup: ``start_plain()`` is called
    once ``main`` is done (not when stopped or failed) and returns a ``LiveRun``, or a finished
    ``LiveSnapshot`` it cached. ``on_plain_done`` gets the finished plain snapshot (to cache it)."""

    def __init__(
        self,
        main: LiveRun,
        settings: RunSettings,
        start_plain: Callable[[], LiveRun | LiveSnapshot] | None = None,
        on_plain_done: Callable[[LiveSnapshot], None] | None = None,
    ) -> None:
        self.main, self.settings, self.start_plain, self.on_plain_done = main, settings, start_plain, on_plain_done
        self.plain: LiveRun | LiveSnapshot | None = None
        self.error: str | None = None
        self.ui = UiCost()

    def poll(self, cursor: dict) -> dict:
        """What is new since ``cursor`` (counts the page already has, ``CURSOR_FIELDS``; missing ones are 0):
        ``pieces`` [[text, label]], ``steps`` (``step_row``s), ``plain_pieces``, ``plain_ms`` (the plain run's
        step times, ms), ``stats`` (the stats line), ``done`` (nothing more will come) and ``error`` (a
        message, or None). Never raises for the run's own errors: they come back as ``error``."""
        began = time.perf_counter()
        at = {name: int(cursor.get(name) or 0) for name in CURSOR_FIELDS}
        main, plain = self._advance()
        done = self.error is not None or (
            main.done and (self.start_plain is None or self.main.stop.is_set() or (plain is not None and plain.done))
        )
        finished = plain is not None and plain.done and not self.main.stop.is_set()
        plain_tps = plain.stats.tokens_per_s if finished else None
        answer = {
            "pieces": main.pieces[at["pieces"] :],
            "steps": [step_row(s) for s in main.stats.steps[at["steps"] :]],
            "plain_pieces": plain.pieces[at["plain_pieces"] :] if plain is not None else [],
            "plain_ms": [round(ms, 1) for ms in self._plain_ms(main, plain)[at["plain_ms"] :]],
            "done": done,
            "error": self.error,
        }
        self.ui.updates += 1
        self.ui.serve_s += time.perf_counter() - began
        answer["stats"] = stats_line(main, self.settings, plain_tps, self._note(main, plain, done))
        return answer

    def _advance(self) -> tuple[LiveSnapshot, LiveSnapshot | None]:
        """Drain both runs; start the plain one once the main one is done; record an error."""
        try:
            main = self.main.update()
            if main.done and self.plain is None and self.start_plain is not None and not self.main.stop.is_set():
                self.plain = self.start_plain()
            if isinstance(self.plain, LiveRun):
                finished = self.plain.snapshot.done
                snapshot = self.plain.update()
                if snapshot.done and not finished and self.on_plain_done is not None and not self.main.stop.is_set():
                    self.on_plain_done(snapshot)
        except Exception as exc:  # noqa: BLE001 — shown in the page; the server keeps serving
            self.error = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        plain = self.plain.snapshot if isinstance(self.plain, LiveRun) else self.plain
        return self.main.snapshot, plain

    def _plain_ms(self, main: LiveSnapshot, plain: LiveSnapshot | None) -> list[float]:
        """Plain decoding's step times: the plain run's, or the main run's own when its method is plain."""
        if self.settings.method == "plain":
            return main.step_intervals_ms()
        return plain.step_intervals_ms() if plain is not None else []

    def _note(self, main: LiveSnapshot, plain: LiveSnapshot | None, done: bool) -> str:
        """The stats line's second line: what is running now, or the page's own cost once done."""
        if self.error is not None:
            return f"error: {self.error}"
        if done:
            return self.ui.line()
        if not main.done:
            return "generating…"
        if plain is None or not plain.stats.new_tokens:
            return "running plain decoding of the same prompt for the speedup…"
        return (
            f"plain decoding of the same prompt, for the speedup: {plain.stats.new_tokens} tokens, "
            f"{plain.stats.tokens_per_s:.1f} tokens/s…"
        )
