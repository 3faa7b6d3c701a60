"""Cost predictors of a profile: the measured table and the SmartSpec linear fit, scored on held-out cells.

A profile cell is the median ms of one forward over n new tokens for b rows on a c-token cache. The
table predictor interpolates the cells linearly over n, then context, then batch (flat below the grid,
linear extrapolation above it, never decreasing); the fit is t = α·(b·c) + γ·(b·n) + δ by least squares
(SmartSpec, arXiv 2406.14066). Each quantity (the target's verification, the draft's 1-token forward,
its ``CATCHUP_CHUNK``-token catch-up chunk) uses the predictor with the lower mean absolute percentage
error on its held-out cells (``score_predictors``). Pure functions over cells; ``profile`` stores them.
"""

from __future__ import annotations

import bisect
import functools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .table import MAX_FORWARD_MS

CATCHUP_CHUNK = 32
QUANTITIES = ("verify", "draft", "catchup")


@dataclass(frozen=True)
class ProfileCell:
    """Median wall time (ms) of one forward over ``new_tokens`` tokens for ``batch`` rows on top of a
    ``context``-token cache, and the timed samples (ms) it is the median of."""

    batch: int
    context: int
    new_tokens: int
    median_ms: float
    samples: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if min(self.batch, self.context, self.new_tokens) < 1:
            raise ValueError(f"batch, context and new_tokens must be >= 1, got {self}")
        if not all(math.isfinite(t) and 0 < t <= MAX_FORWARD_MS for t in (self.median_ms, *self.samples)):
            raise ValueError(f"median_ms and samples must be finite and in (0, {MAX_FORWARD_MS}] ms, got {self}")
        if self.samples and not min(self.samples) <= self.median_ms <= max(self.samples):
            raise ValueError(f"median_ms {self.median_ms} lies outside its samples {self.samples}")


@dataclass(frozen=True)
class CostFit:
    """t(b, c, n) = alpha·(b·c) + gamma·(b·n) + delta, in ms (SmartSpec, arXiv 2406.14066)."""

    alpha: float
    gamma: float
    delta: float

    def __post_init__(self) -> None:
        if not all(isinstance(v, int | float) and math.isfinite(v) for v in (self.alpha, self.gamma, self.delta)):
            raise ValueError(f"fit coefficients must be finite numbers, got {self}")

    def predict(self, batch: int, context: int, new_tokens: int) -> float:
        """Predicted ms, floored at 1 µs (a fit may dip below zero off its data)."""
        return max(self.alpha * batch * context + self.gamma * batch * new_tokens + self.delta, 1e-3)


def interp1(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear y(x) through points with increasing ``xs``: flat below the first point, linear
    extrapolation along the last segment above the last one (slope clamped at ≥ 0: a bigger forward
    never costs less)."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = bisect.bisect_left(xs, x)
    if i == len(xs):
        slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
        return ys[-1] + slope * (x - xs[-1])
    w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + w * (ys[i] - ys[i - 1])


def table_predict(cells: Sequence[ProfileCell], batch: int, context: int, new_tokens: int) -> float:
    """The table predictor (ms): ``interp1`` over n within each measured (b, c), then over context
    within each b, then over batch. Raises ValueError for no cells."""
    if not cells:
        raise ValueError("no measured cells to predict from")
    nested: dict[int, dict[int, list[tuple[int, float]]]] = {}
    for cell in cells:
        nested.setdefault(cell.batch, {}).setdefault(cell.context, []).append((cell.new_tokens, cell.median_ms))

    def at_batch(per_context: dict[int, list[tuple[int, float]]]) -> float:
        contexts = sorted(per_context)
        by_n = [sorted(per_context[c]) for c in contexts]
        return interp1(contexts, [interp1([n for n, _ in p], [t for _, t in p], new_tokens) for p in by_n], context)

    batches = sorted(nested)
    return interp1(batches, [at_batch(nested[b]) for b in batches], batch)


def fit_costs(cells: Sequence[ProfileCell]) -> CostFit:
    """Least-squares (``torch.linalg.lstsq``, float64) fit of t = α·(b·c) + γ·(b·n) + δ to the cells."""
    if not cells:
        raise ValueError("no measured cells to fit")
    design = torch.tensor([[c.batch * c.context, c.batch * c.new_tokens, 1.0] for c in cells], dtype=torch.float64)
    times = torch.tensor([[c.median_ms] for c in cells], dtype=torch.float64)
    alpha, gamma, delta = torch.linalg.lstsq(design, times, driver="gelsd").solution.flatten().tolist()
    return CostFit(alpha, gamma, delta)


def _relative_errors(predict: Callable[[int, int, int], float], cells: Sequence[ProfileCell]) -> list[float]:
    return [abs(predict(c.batch, c.context, c.new_tokens) - c.median_ms) / c.median_ms for c in cells]


def choose_predictor(table_mape: float | None, fit_mape: float | None) -> str:
    """ "fit" only when it has a held-out error strictly below the table's, else "table"."""
    if fit_mape is not None and (table_mape is None or fit_mape < table_mape):
        return "fit"
    return "table"


@dataclass(frozen=True)
class HeldOutScore:
    """One quantity's held-out mean absolute percentage errors (%) of the table and the fit (None: no
    held-out cell for it), and the predictor they choose."""

    table_mape: float | None = None
    fit_mape: float | None = None

    @property
    def predictor(self) -> str:
        """``choose_predictor`` of the two errors."""
        return choose_predictor(self.table_mape, self.fit_mape)


def _mape(predict: Callable[[int, int, int], float], held: Sequence[ProfileCell]) -> float | None:
    """Mean absolute percentage error (%) of ``predict`` on ``held``; None without held-out cells."""
    return 100.0 * statistics.fmean(_relative_errors(predict, held)) if held else None


def score_predictors(
    cells: dict[str, tuple[ProfileCell, ...]], target_fit: CostFit, draft_fit: CostFit | None
) -> dict[str, HeldOutScore]:
    """Per quantity (``QUANTITIES``), both predictors' errors on its held-out cells: verification on
    "held_out_target", the draft token and the catch-up chunk on "held_out_draft" cells of 1 and
    ``CATCHUP_CHUNK`` new tokens. ``cells``: the four cell groups, as in ``assemble_profile``."""
    held_draft = cells.get("held_out_draft", ())
    groups = {
        "verify": (cells["target"], target_fit, cells.get("held_out_target", ())),
        "draft": (cells.get("draft", ()), draft_fit, [c for c in held_draft if c.new_tokens == 1]),
        "catchup": (cells.get("draft", ()), draft_fit, [c for c in held_draft if c.new_tokens == CATCHUP_CHUNK]),
    }
    return {
        q: HeldOutScore(
            _mape(functools.partial(table_predict, grid), held) if grid else None,
            _mape(fit.predict, held) if fit is not None else None,
        )
        for q, (grid, fit, held) in groups.items()
    }
