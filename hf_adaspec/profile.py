"""Cost profiles: step latency vs new tokens × batch × context, two predictors, and the engine's lookup.

Design: the per-pair ``CostTable`` of ``costs`` is measured at one context (128 tokens). A profile
(measured by ``profiling.measure_profile``, the ``hf-adaspec profile`` command) holds the median ms of
target forwards over n new tokens at batch b on top of a c-token context, and of the draft's 1-token
forward and 32-token catch-up chunk vs (b, c). Two predictors: (a) the table, linearly interpolated over
n, then context, then batch (flat below the grid, linear extrapolation above it); (b) a least-squares
fit t = α·(b·c) + γ·(b·n) + δ per model (SmartSpec, arXiv 2406.14066: a batch's step cost is
linear in its context and new tokens). Off-grid "held-out" cells, used for neither, give each
predictor's mean absolute percentage error; lookups use the lower one. Profiles are JSON written
atomically and verified by reading back; the engine uses one only when its key (models, dtype,
quantization, device, library versions, machine, threads) matches the loaded pair (``find_profile``).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .assets import cache_dir
from .costs import CostTable, _atomic_write_json, identity_key, pair_identity

SCHEMA = 1
PROFILE_ENV = "HF_ADASPEC_PROFILE"
PREDICTORS = ("table", "fit")
CATCHUP_CHUNK = 32
_FIX = "re-run `hf-adaspec profile` to measure it again"


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
        if not self.median_ms > 0:
            raise ValueError(f"median_ms must be > 0, got {self.median_ms}")


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
    """"fit" only when it has a held-out error strictly below the table's, else "table"."""
    if fit_mape is not None and (table_mape is None or fit_mape < table_mape):
        return "fit"
    return "table"


@dataclass(frozen=True)
class Profile:
    """A measured cost profile of a (target, draft) pair: cells, fits, held-out errors, chosen predictor.

    ``key``/``identity``: what it was measured for (``profile_identity``); ``meta``: versions, machine,
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
    table_mape: float | None
    fit_mape: float | None
    predictor: str
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.predictor not in PREDICTORS:
            raise ValueError(f"predictor must be one of {PREDICTORS}, got {self.predictor!r}")
        if not self.target_cells:
            raise ValueError("a profile needs measured target cells")
        if (self.draft_fit is None) != (not self.draft_cells):
            raise ValueError("draft cells and draft fit must be given together")

    def _predict(self, cells: Sequence[ProfileCell], fit: CostFit, batch: int, context: int, n: int) -> float:
        if min(batch, context, n) < 1:
            raise ValueError(f"batch, context and new tokens must be >= 1, got {batch}, {context}, {n}")
        return fit.predict(batch, context, n) if self.predictor == "fit" else table_predict(cells, batch, context, n)

    def verify_ms(self, batch: int, context: int, new_tokens: int) -> float:
        """Predicted ms of a target forward over ``new_tokens`` for ``batch`` rows at ``context``."""
        return self._predict(self.target_cells, self.target_fit, batch, context, new_tokens)

    def draft_ms(self, batch: int, context: int) -> float:
        """Predicted ms of the draft's 1-token forward (one draft token per row); 0 without a draft."""
        return self._predict(self.draft_cells, self.draft_fit, batch, context, 1) if self.draft_fit else 0.0

    def catchup_ms(self, batch: int, context: int) -> float:
        """Predicted ms per token column the draft ingests, from its 32-token chunk; 0 without a draft."""
        if self.draft_fit is None:
            return 0.0
        return self._predict(self.draft_cells, self.draft_fit, batch, context, CATCHUP_CHUNK) / CATCHUP_CHUNK

    def cost_table(self, batch: int, context: int, n_max: int) -> CostTable:
        """The ``CostTable`` the controllers use, at this batch size and context (tokens), n = 1..n_max."""
        if n_max < 1:
            raise ValueError(f"n_max must be >= 1, got {n_max}")
        verify = tuple(self.verify_ms(batch, context, n) for n in range(1, n_max + 1))
        return CostTable(verify, self.draft_ms(batch, context), context, self.key, self.catchup_ms(batch, context))

    def to_json(self) -> dict:
        """The JSON document ``save_profile`` writes (schema ``SCHEMA``)."""
        cells = _cells_json
        return {"schema": SCHEMA, "pair": self.pair, "key": self.key, "identity": self.identity, **self.meta,
                "target_cells": cells(self.target_cells), "draft_cells": cells(self.draft_cells),
                "held_out_target": cells(self.held_out_target), "held_out_draft": cells(self.held_out_draft),
                "fit": {"target": asdict(self.target_fit), "draft": asdict(self.draft_fit) if self.draft_fit else None},
                "held_out_mape_pct": {"table": self.table_mape, "fit": self.fit_mape}, "predictor": self.predictor}


def _cells_json(cells: Sequence[ProfileCell]) -> list[dict]:
    return [{**asdict(c), "samples": list(c.samples)} for c in cells]


def assemble_profile(pair: str, identity: dict, cells: dict[str, Sequence[ProfileCell]], meta: dict) -> Profile:
    """Fit both models, score both predictors on the held-out cells and pick the better one.

    ``cells``: "target", "draft", "held_out_target", "held_out_draft" → cells (draft ones may be empty).
    """
    target, draft = tuple(cells["target"]), tuple(cells.get("draft", ()))
    ho_target, ho_draft = tuple(cells.get("held_out_target", ())), tuple(cells.get("held_out_draft", ()))
    target_fit, draft_fit = fit_costs(target), fit_costs(draft) if draft else None
    table_errors = _relative_errors(functools.partial(table_predict, target), ho_target)
    fit_errors = _relative_errors(target_fit.predict, ho_target)
    if draft_fit is not None:
        table_errors += _relative_errors(functools.partial(table_predict, draft), ho_draft)
        fit_errors += _relative_errors(draft_fit.predict, ho_draft)
    table_err = 100.0 * statistics.fmean(table_errors) if table_errors else None
    fit_err = 100.0 * statistics.fmean(fit_errors) if fit_errors else None
    return Profile(pair, identity_key(identity), identity, target, draft, ho_target, ho_draft, target_fit,
                   draft_fit, table_err, fit_err, choose_predictor(table_err, fit_err), meta)


def profile_identity(target: torch.nn.Module, draft: torch.nn.Module | None) -> dict:
    """What a profile holds for: ``costs.pair_identity`` (models, torch/transformers, machine, threads)
    plus the bitsandbytes version and this module's schema."""
    bnb = library_versions()["bitsandbytes"]
    return {"profile_schema": SCHEMA, **pair_identity(target, draft), "bitsandbytes": bnb}


def profile_key(target: torch.nn.Module, draft: torch.nn.Module | None) -> str:
    """The key a profile of this pair on this machine carries (and its cache file name)."""
    return identity_key(profile_identity(target, draft))


def default_profile_path(key: str) -> Path:
    """Where the engine looks for a profile without an explicit path: ``<cache>/profiles/<key>.json``."""
    return cache_dir() / "profiles" / f"{key}.json"


def library_versions() -> dict[str, str | None]:
    """Installed torch, transformers and bitsandbytes versions (None when not installed)."""
    import importlib.metadata

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"torch": torch.__version__, "transformers": version("transformers"),
            "bitsandbytes": version("bitsandbytes")}


_META_FIELDS = ("versions", "machine", "cpu", "threads", "created", "command", "grid")
_FIELDS = ("schema", "pair", "key", "identity", "target_cells", "draft_cells", "held_out_target", "held_out_draft",
           "fit", "held_out_mape_pct", "predictor", *_META_FIELDS)


def _from_json(data: dict) -> Profile:
    """Profile from its JSON document; raises KeyError/TypeError/ValueError on anything malformed."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    missing = [f for f in _FIELDS if f not in data]
    if missing:
        raise ValueError(f"missing fields {missing}")
    if data["schema"] != SCHEMA:
        raise ValueError(f"schema {data['schema']!r}, this version reads {SCHEMA}")
    if data["key"] != identity_key(data["identity"]):
        raise ValueError("its key does not match its identity (edited by hand?)")
    cells = {name: tuple(ProfileCell(**{**c, "samples": tuple(c["samples"])}) for c in data[name])
             for name in ("target_cells", "draft_cells", "held_out_target", "held_out_draft")}
    fits, errors = data["fit"], data["held_out_mape_pct"]
    for value in errors.values():
        if value is not None and not isinstance(value, int | float):
            raise TypeError(f"held-out errors must be numbers or null, got {errors}")
    return Profile(data["pair"], data["key"], data["identity"], *cells.values(), CostFit(**fits["target"]),
                   CostFit(**fits["draft"]) if fits["draft"] is not None else None, errors["table"], errors["fit"],
                   data["predictor"], {k: data[k] for k in _META_FIELDS})


def _missing(path: Path) -> str:
    return f"no cost profile at {path}; run `hf-adaspec profile --output {path}` to measure one"


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile written by ``save_profile``.

    Raises ValueError naming the file and the fix (re-run ``hf-adaspec profile``) when it is missing,
    not JSON, of another schema, or has missing or malformed fields.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(_missing(path)) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cost profile {path} is unreadable ({e}); {_FIX}") from None
    try:
        return _from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"cost profile {path} is invalid ({e}); {_FIX}") from None


def save_profile(profile: Profile, path: str | Path) -> Path:
    """Write ``profile`` as JSON atomically (temp file + rename), read it back and compare; returns the path.
    Raises OSError when what was read back differs from what was written."""
    path = Path(path)
    document = profile.to_json()
    _atomic_write_json(path, document)
    if json.dumps(load_profile(path).to_json(), sort_keys=True) != json.dumps(document, sort_keys=True):
        raise OSError(f"cost profile {path} did not read back as written; check the disk, then {_FIX}")
    return path


_LOADED: dict[tuple[str, int, int], Profile] = {}
_ANNOUNCED: set[str] = set()


def _load_cached(path: Path) -> Profile:
    """``load_profile`` once per file version (path, mtime, size) in this process."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        raise ValueError(_missing(path)) from None
    version = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
    if version not in _LOADED:
        _LOADED[version] = load_profile(path)
    return _LOADED[version]


def _say_once(log: Callable[[str], None], message: str) -> None:
    if message not in _ANNOUNCED:
        _ANNOUNCED.add(message)
        log(message)


def _differences(now: dict, then: dict) -> list[str]:
    """Dotted names of the identity fields that differ (one level into the model identities)."""
    out = []
    for k in sorted(now.keys() | then.keys()):
        a, b = now.get(k), then.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += [f"{k}.{s}" for s in sorted(a.keys() | b.keys()) if a.get(s) != b.get(s)]
        elif a != b:
            out.append(k)
    return out


def find_profile(target: torch.nn.Module, draft: torch.nn.Module | None, explicit: str | Path | None = None,
                 log: Callable[[str], None] = print) -> Profile | None:
    """The cost profile of this pair: ``explicit`` (a path), else ``$HF_ADASPEC_PROFILE``, else
    ``<cache>/profiles/<key>.json``; logs (once per message) which one is used.

    Returns None when the cache holds none (or an unreadable one, with a note), and None with a warning
    when the profile was measured for other models, versions, machine or threads. Raises ValueError
    when an explicitly given profile is missing or invalid.
    """
    identity = profile_identity(target, draft)
    chosen = explicit or os.environ.get(PROFILE_ENV) or None
    path = Path(chosen) if chosen else default_profile_path(identity_key(identity))
    if chosen is None and not path.exists():
        return None
    try:
        profile = _load_cached(path)
    except ValueError as e:
        if chosen:
            raise
        _say_once(log, f"hf-adaspec: ignoring the cached cost profile: {e}")
        return None
    if profile.key != identity_key(identity):
        _say_once(log, f"hf-adaspec: warning: cost profile {path} was measured for other models/versions "
                       f"(differs in: {', '.join(_differences(identity, profile.identity))}); falling back to "
                       "calibrated costs; run `hf-adaspec profile` for this pair")
        return None
    _say_once(log, f"hf-adaspec: using cost profile {path} ({profile.predictor})")
    return profile
