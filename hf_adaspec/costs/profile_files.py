"""Cost profile files: a profile's key, its JSON file, and the one the engine uses.

Design: a profile is keyed by what it was measured for (``profile_identity``: ``table.pair_identity``'s models,
dtype, quantization, device, library versions, machine and threads, plus the bitsandbytes version and the
measurement schema; ``profile_key`` is its ``table.identity_key``, also the cache file's name,
``default_profile_path``). ``save_profile`` writes the JSON document (``Profile.to_json``) atomically with its
digest (``files.write_json_verified``) and reads it back to compare; ``load_profile`` checks the digest, the
schema, the key against the identity and every cell, and recomputes the held-out scores from the stored cells.
The engine uses one (``find_profile``: an explicit path, else ``$HF_ADASPEC_PROFILE``, else the cache's file for
the key) only when its key matches the loaded pair (without a draft model, a pair's profile of the same target
serves) and, for a target on the CPU, when it was measured on this processor; otherwise it warns once and falls
back to calibrated costs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from .. import machine
from ..files import read_json_verified, sweep, write_json_verified
from ..models.assets import cache_dir
from .predictors import QUANTITIES, CostFit, ProfileCell, score_predictors
from .profile import SCHEMA, Profile
from .table import identity_key, pair_identity

MEASUREMENT_SCHEMA = 1  # what the cells mean, part of a profile's key
PROFILE_ENV = "HF_ADASPEC_PROFILE"
_FIX = "re-run `hf-adaspec profile` to measure it again"


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
