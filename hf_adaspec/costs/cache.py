"""Where the controllers' costs come from: a matching cost profile (``profile.find_profile``), else
tables calibrated at context 128 and cached per model pair under ``<cache>/costs/<key>.json``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..files import read_json_verified, sweep, write_json_verified
from ..models.assets import cache_dir
from .profile_files import find_profile
from .table import CostTable, measure, table_key

TABLE_ERRORS = (OSError, ValueError, KeyError, TypeError)  # what ``read_table`` raises for a bad file


def read_table(path: Path) -> CostTable:
    """The cached ``CostTable`` at ``path``, its digest and values checked (the whole file is read: a full
    check). Raises one of ``TABLE_ERRORS``: missing or unreadable, edited or corrupted, implausible values."""
    data = read_json_verified(path)
    return CostTable(**{**data, "verify_ms": tuple(data["verify_ms"])})


@dataclass
class CostCache:
    """Where the controllers' costs come from: a matching cost profile (``profile.find_profile``), else
    tables calibrated at context 128 and cached per model pair under ``<cache>/costs/<key>.json``."""

    root: Path = field(default_factory=lambda: cache_dir() / "costs")

    def load_or_measure(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module | None,
        n_max: int,
        log: Callable[[str], None],
        batch: int = 1,
        context: int = 128,
        profile: str | Path | None = None,
        kv_cache: str = "auto",
    ) -> CostTable:
        """The pair's table at ``batch`` rows: from a matching cost profile at ``context`` tokens
        (``profile``: its path; else $HF_ADASPEC_PROFILE or the cached profile of this pair), else the
        cached calibration, else calibrate (seconds) and cache it. Raises ValueError when an explicitly
        given profile is missing or invalid."""
        found = find_profile(target, draft, profile, log, kv_cache)
        if found is not None:
            return found.cost_table(batch, context, n_max)
        return self._calibrated(target, draft, n_max, log, batch, kv_cache)

    def costs_for(
        self,
        target: torch.nn.Module,
        draft: torch.nn.Module | None,
        n_max: int,
        log: Callable[[str], None],
        batch: int,
        context: int = 128,
        profile: str | Path | None = None,
        kv_cache: str = "auto",
    ) -> Callable[[int], CostTable]:
        """costs_for(b) for a static batch of up to ``batch`` rows: a matching profile's table at b rows and
        ``context`` tokens; else tables calibrated at b = 1, 2, 4, … and ``batch``, b rows using the table
        of the smallest calibrated size ≥ b. Raises ValueError as ``load_or_measure``."""
        found = find_profile(target, draft, profile, log, kv_cache)
        if found is not None:
            return functools.cache(lambda b: found.cost_table(b, context, n_max))
        sizes = sorted({min(2**i, batch) for i in range(batch.bit_length() + 1)})
        tables = {b: self._calibrated(target, draft, n_max, log, b, kv_cache) for b in sizes}
        return lambda b: tables[min(s for s in sizes if s >= b)]

    def _calibrated(
        self, target, draft, n_max: int, log: Callable[[str], None], batch: int, kv_cache: str = "auto"
    ) -> CostTable:
        """The cached calibration at ``batch`` rows, or calibrate (seconds) and cache it. A cached table is
        used only if its digest and values check out (finite, positive, at most ``MAX_FORWARD_MS``);
        otherwise it is measured again and replaced. Where it cannot be cached (the path is a folder, a
        read-only disk) the measured table is used and the reason logged."""
        key = table_key(target, draft, n_max, batch, kv_cache)
        path = self.root / f"{key}.json"
        sweep(self.root)
        if path.exists():
            try:
                return read_table(path)
            except TABLE_ERRORS as e:
                log(f"hf-adaspec: ignoring cost table {path} ({e}); recalibrating")
        log(
            f"hf-adaspec: calibrating step costs for this model pair at batch {batch} (first use), cached at {path}; "
            "run `hf-adaspec profile` for context-aware costs"
        )
        table = measure(target, draft, n_max, batch=batch, kv_cache=kv_cache)
        try:
            write_json_verified(path, {**asdict(table), "verify_ms": list(table.verify_ms)})
        except OSError as e:
            log(f"hf-adaspec: warning: could not cache the cost table ({e}); it is measured again next time")
        return table
