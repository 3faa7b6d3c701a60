"""Cost profiles: step latency vs new tokens × batch × context and two predictors.

Design: the per-pair ``CostTable`` of ``table`` is measured at one context (128 tokens). A profile
(measured by ``measure.measure_profile``, the ``hf-adaspec profile`` command) holds the median ms of
target forwards over n new tokens at batch b on top of a c-token context, and of the draft's 1-token
forward and 32-token catch-up chunk vs (b, c). Two predictors (``predictors``): (a) the table,
linearly interpolated over n, then context, then batch (flat below the grid, linear extrapolation
above it); (b) a least-squares fit t = α·(b·c) + γ·(b·n) + δ per model (SmartSpec, arXiv 2406.14066: a
batch's step cost is linear in its context and new tokens). Off-grid "held-out" cells, used for
neither, give each predictor's mean absolute percentage error per quantity (the target's verification,
the draft's 1-token forward, its catch-up chunk), and each quantity uses its lower one (one pooled
choice lets the many-token and large-batch cells pick a predictor for all three; docs/experiments.md,
row "Per-quantity cost predictors"). A profile's key, its JSON file and the engine's lookup of one live in
``profile_files``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from ..models.eagle3 import Eagle3Head
from .predictors import (
    CATCHUP_CHUNK,
    QUANTITIES,
    CostFit,
    HeldOutScore,
    ProfileCell,
    fit_costs,
    score_predictors,
    table_predict,
)
from .table import CostTable, identity_key

SCHEMA = 3  # the JSON layout; 3 added the digest (``files.write_json_verified``), so 1 and 2 are not trusted
PREDICTORS = ("table", "fit")


@dataclass(frozen=True)
class Profile:
    """A measured cost profile of a (target, draft) pair: cells, fits, and per quantity (``QUANTITIES``)
    the held-out errors that choose its predictor (``scores``).

    ``key``/``identity``: what it was measured for (``profile_files.profile_identity``); ``meta``: versions, machine,
    cpu, threads, creation time, command line and grid. All costs in ms.
    """

    pair: str
    key: str
    identity: dict
    target_cells: tuple[ProfileCell, ...]
    draft_cells: tuple[ProfileCell, ...]
    held_out_target: tuple[ProfileCell, ...]
    held_out_draft: tuple[ProfileCell, ...]
    target_fit: CostFit
    draft_fit: CostFit | None
    scores: dict[str, HeldOutScore]
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if set(self.scores) != set(QUANTITIES):
            raise ValueError(f"scores must cover {QUANTITIES}, got {sorted(self.scores)}")
        if not self.target_cells:
            raise ValueError("a profile needs measured target cells")
        if (self.draft_fit is None) != (not self.draft_cells):
            raise ValueError("draft cells and draft fit must be given together")

    @property
    def drafter_is_head(self) -> bool:
        """Whether the drafter cells are an EAGLE-3 draft head's (``hf-adaspec profile --head``), as its
        identity records the drafter's class."""
        return (self.identity.get("draft") or {}).get("name") == Eagle3Head.__name__

    def predictor(self, quantity: str) -> str:
        """ "table" or "fit": the one with the lower held-out error for ``quantity`` (``QUANTITIES``)."""
        return self.scores[quantity].predictor

    def _predict(self, quantity: str, batch: int, context: int, n: int, forced: str | None = None) -> float:
        if min(batch, context, n) < 1:
            raise ValueError(f"batch, context and new tokens must be >= 1, got {batch}, {context}, {n}")
        verify = quantity == "verify"
        cells, fit = (self.target_cells, self.target_fit) if verify else (self.draft_cells, self.draft_fit)
        use = forced or self.predictor(quantity)
        return fit.predict(batch, context, n) if use == "fit" else table_predict(cells, batch, context, n)

    def verify_ms(self, batch: int, context: int, new_tokens: int, forced: str | None = None) -> float:
        """Predicted ms of a target forward over ``new_tokens`` for ``batch`` rows at ``context``
        (``forced``: that predictor instead of the chosen one)."""
        return self._predict("verify", batch, context, new_tokens, forced)

    def draft_ms(self, batch: int, context: int, forced: str | None = None) -> float:
        """Predicted ms of the draft's 1-token forward (one draft token per row); 0 without a draft."""
        return self._predict("draft", batch, context, 1, forced) if self.draft_fit else 0.0

    def catchup_ms(self, batch: int, context: int, forced: str | None = None) -> float:
        """Predicted ms per token column the draft ingests, from its 32-token chunk; 0 without a draft."""
        if self.draft_fit is None:
            return 0.0
        return self._predict("catchup", batch, context, CATCHUP_CHUNK, forced) / CATCHUP_CHUNK

    def cost_table(self, batch: int, context: int, n_max: int, forced: str | None = None) -> CostTable:
        """The ``CostTable`` the controllers use, at this batch size and context (tokens), n = 1..n_max;
        ``forced`` ("table" or "fit"): every quantity from that predictor (an ablation).

        Raises:
            ValueError: n_max < 1 or an unknown ``forced`` predictor.
        """
        if n_max < 1:
            raise ValueError(f"n_max must be >= 1, got {n_max}")
        if forced is not None and forced not in PREDICTORS:
            raise ValueError(f"forced predictor must be one of {PREDICTORS}, got {forced!r}")
        verify = tuple(self.verify_ms(batch, context, n, forced) for n in range(1, n_max + 1))
        return CostTable(
            verify, self.draft_ms(batch, context, forced), context, self.key, self.catchup_ms(batch, context, forced)
        )

    def to_json(self) -> dict:
        """The JSON document ``profile_files.save_profile`` writes (schema ``SCHEMA``)."""
        cells = _cells_json
        return {
            "schema": SCHEMA,
            "pair": self.pair,
            "key": self.key,
            "identity": self.identity,
            **self.meta,
            "target_cells": cells(self.target_cells),
            "draft_cells": cells(self.draft_cells),
            "held_out_target": cells(self.held_out_target),
            "held_out_draft": cells(self.held_out_draft),
            "fit": {"target": asdict(self.target_fit), "draft": asdict(self.draft_fit) if self.draft_fit else None},
            "held_out_mape_pct": {q: {"table": s.table_mape, "fit": s.fit_mape} for q, s in self.scores.items()},
            "predictors": {q: s.predictor for q, s in self.scores.items()},
        }


def _cells_json(cells: Sequence[ProfileCell]) -> list[dict]:
    return [{**asdict(c), "samples": list(c.samples)} for c in cells]


def assemble_profile(pair: str, identity: dict, cells: dict[str, Sequence[ProfileCell]], meta: dict) -> Profile:
    """Fit both models and score both predictors per quantity on the held-out cells (``score_predictors``).

    ``cells``: "target", "draft", "held_out_target", "held_out_draft" → cells (draft ones may be empty).
    """
    groups = {name: tuple(cells.get(name, ())) for name in ("target", "draft", "held_out_target", "held_out_draft")}
    target_fit = fit_costs(groups["target"])
    draft_fit = fit_costs(groups["draft"]) if groups["draft"] else None
    return Profile(
        pair,
        identity_key(identity),
        identity,
        *groups.values(),
        target_fit,
        draft_fit,
        score_predictors(groups, target_fit, draft_fit),
        meta,
    )
