"""Cost profiles: step latency vs new tokens × batch × context, two predictors, and the engine's lookup.

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
row "Per-quantity cost predictors"). Profiles are JSON written atomically and verified by reading back;
the engine uses one only when its key (models, dtype, quantization, device, library versions, machine,
threads) matches the loaded pair (``find_profile``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .. import machine
from ..files import read_json_verified, sweep, write_json_verified
from ..models.assets import cache_dir
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
from .table import CostTable, identity_key, pair_identity

SCHEMA = 3  # the JSON layout; 3 added the digest (``files.write_json_verified``), so 1 and 2 are not trusted
MEASUREMENT_SCHEMA = 1  # what the cells mean, part of a profile's key
PROFILE_ENV = "HF_ADASPEC_PROFILE"
PREDICTORS = ("table", "fit")
_FIX = "re-run `hf-adaspec profile` to measure it again"


@dataclass(frozen=True)
class Profile:
    """A measured cost profile of a (target, draft) pair: cells, fits, and per quantity (``QUANTITIES``)
    the held-out errors that choose its predictor (``scores``).

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
        """The JSON document ``save_profile`` writes (schema ``SCHEMA``)."""
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


def profile_identity(target: torch.nn.Module, draft: torch.nn.Module | None, kv_cache: str = "auto") -> dict:
    """What a profile holds for: ``table.pair_identity`` (models, torch/transformers, machine, threads, the
    kind of KV cache ``kv_cache`` gives the target) plus the bitsandbytes version and the measurement schema."""
    bnb = library_versions()["bitsandbytes"]
    return {"profile_schema": MEASUREMENT_SCHEMA, **pair_identity(target, draft, kv_cache), "bitsandbytes": bnb}


def profile_key(target: torch.nn.Module, draft: torch.nn.Module | None, kv_cache: str = "auto") -> str:
    """The key a profile of this pair on this machine carries (and its cache file name)."""
    return identity_key(profile_identity(target, draft, kv_cache))


def default_profile_path(key: str) -> Path:
    """Where the engine looks for a profile without an explicit path: ``<cache>/profiles/<key>.json``."""
    return cache_dir() / "profiles" / f"{key}.json"


def library_versions() -> dict[str, str | None]:
    """Installed torch, transformers and bitsandbytes versions (None when not installed)."""
    return {**machine.versions("transformers", "bitsandbytes"), "torch": torch.__version__}


_META_FIELDS = ("versions", "machine", "cpu", "threads", "created", "command", "grid")
_FIELDS = (
    "schema",
    "pair",
    "key",
    "identity",
    "target_cells",
    "draft_cells",
    "held_out_target",
    "held_out_draft",
    "fit",
    *_META_FIELDS,
)


def _from_json(data: dict) -> Profile:
    """Profile from its JSON document (digest already checked); raises KeyError/TypeError/ValueError on
    anything malformed or implausible (``ProfileCell``). The held-out scores and predictors are
    recomputed from the stored cells."""
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    missing = [f for f in _FIELDS if f not in data]
    if missing:
        raise ValueError(f"missing fields {missing}")
    if data["schema"] != SCHEMA:
        raise ValueError(f"schema {data['schema']!r}, this version reads {SCHEMA}")
    if data["key"] != identity_key(data["identity"]):
        raise ValueError("its key does not match its identity (edited by hand?)")
    cells = {
        name: tuple(ProfileCell(**{**c, "samples": tuple(c["samples"])}) for c in data[name])
        for name in ("target_cells", "draft_cells", "held_out_target", "held_out_draft")
    }
    fits = data["fit"]
    target_fit = CostFit(**fits["target"])
    draft_fit = CostFit(**fits["draft"]) if fits["draft"] is not None else None
    groups = {
        "target": cells["target_cells"],
        "draft": cells["draft_cells"],
        "held_out_target": cells["held_out_target"],
        "held_out_draft": cells["held_out_draft"],
    }
    return Profile(
        data["pair"],
        data["key"],
        data["identity"],
        *cells.values(),
        target_fit,
        draft_fit,
        score_predictors(groups, target_fit, draft_fit),
        {k: data[k] for k in _META_FIELDS},
    )


def _missing(path: Path) -> str:
    return f"no cost profile at {path}; run `hf-adaspec profile --output {path}` to measure one"


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile written by ``save_profile``.

    Raises ValueError naming the file and the fix (re-run ``hf-adaspec profile``) when it is missing,
    not JSON, a folder, of another schema, edited or corrupted (its digest does not match), or has
    missing, malformed or implausible fields (not finite, not positive, over ``MAX_FORWARD_MS``).
    """
    path = Path(path)
    try:
        data = read_json_verified(path)
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
    sweep(path.parent)  # what an interrupted save left
    write_json_verified(path, document)
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


def _same_target(now: dict, then: dict) -> bool:
    """Both identities name the same target, versions, machine and threads (the draft aside)."""
    return {k: v for k, v in now.items() if k != "draft"} == {k: v for k, v in then.items() if k != "draft"}


def find_profile(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    explicit: str | Path | None = None,
    log: Callable[[str], None] = print,
    kv_cache: str = "auto",
) -> Profile | None:
    """The cost profile of this pair: ``explicit`` (a path), else ``$HF_ADASPEC_PROFILE``, else
    ``<cache>/profiles/<key>.json``; logs (once per message) which one is used.

    Returns None when the cache holds none (or an unreadable one, with a note), and None with a warning
    when the profile was measured for other models, versions, machine or threads, or (for a target on the
    CPU) on another processor model (its ``cpu``); without a draft model
    (``draft`` None) a pair's profile of the same target serves (its target cells). Raises ValueError
    when an explicitly given profile is missing or invalid.
    """
    identity = profile_identity(target, draft, kv_cache)
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
    measured_on = profile.meta.get("cpu")
    if identity["target"]["device"] == "cpu" and measured_on not in (None, machine.processor_name()):
        _say_once(
            log,
            f"hf-adaspec: warning: cost profile {path} was measured on another processor ({measured_on}; "
            f"this one is {machine.processor_name()}); falling back to calibrated costs; "
            "run `hf-adaspec profile` here",
        )
        return None
    if profile.key != identity_key(identity) and draft is None and _same_target(identity, profile.identity):
        _say_once(log, f"hf-adaspec: using the target's cells of cost profile {path} (no draft model)")
        return profile  # its draft costs go unused: without a draft model no drafter pays them
    if profile.key != identity_key(identity):
        _say_once(
            log,
            f"hf-adaspec: warning: cost profile {path} was measured for other models/versions "
            f"(differs in: {', '.join(_differences(identity, profile.identity))}); falling back to "
            "calibrated costs; run `hf-adaspec profile` for this pair",
        )
        return None
    chosen = ", ".join(f"{q}: {profile.predictor(q)}" for q in QUANTITIES)
    _say_once(log, f"hf-adaspec: using cost profile {path} ({chosen})")
    return profile
