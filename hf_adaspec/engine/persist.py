"""A pair's learned statistics on disk, so that a new process starts from what earlier ones learned.

Design: what a ``SpeculationState`` learns comes in two kinds. Statistics — the draft's confidence calibration
(per bin, trials and successes) and the costless drafters' acceptance per match length (per bucket, discounted
trials and successes) — describe the pair, not any prompt; they are what this module writes. The rest is a
prompt's output, or this machine's load of the moment, and is never written: suffix drafting's recent responses
and the draft's recent caches (token ids: a benchmark's timed run must not start from a state that has seen its
prompts, nor a file carry a user's text) and the thread chooser.

A file is one JSON document (``files.write_json_verified``: written atomically, its SHA-256 checked at every
read) holding ``FORMAT``, ``VERSION``, the pair it was learned on (``PairKey``: the target's and the assistant's
weights identities, ``hf_compat.weights_identity`` and ``policy.modes.assistant_identity``) and the counts
(``CalibratorMemory.counts``, ``MatchMemory.counts``, by drafter key). ``read_learned`` trusts a file only whole:
a corrupt file, another format or version, another pair's file, or counts that no learning reaches raise
``LearnedStateError`` naming the file, the reason and the fix, and nothing is restored. The library reads a
file only where asked (``SpeculationState.load``; ``hf-adaspec generate``'s per-pair file, ``cache_path``): a
``SpeculationState()`` is always fresh, and the benchmarks build fresh ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..backend import hf_compat
from ..files import read_json_verified, write_json_verified
from ..machine import versions
from ..models.assets import cache_dir
from ..policy.confidence import CalibratorMemory
from ..policy.match import MatchMemory
from ..policy.modes import assistant_identity

FORMAT = "hf-adaspec learned state"
VERSION = 1  # raised whenever what the counts mean changes; a file of another version is refused
FOLDER = "learned"  # under the cache root: one file per pair


class LearnedStateError(ValueError):
    """A learned-state file that cannot be used: its message names the file, why, and the fix."""


@dataclass(frozen=True)
class PairKey:
    """The pair a learned state belongs to: the target's weights identity and the assistant's
    (``policy.modes.assistant_identity``: "none" without one).

    Raises:
        ValueError: an empty identity.
    """

    target: str
    assistant: str

    def __post_init__(self) -> None:
        if not (isinstance(self.target, str) and self.target and isinstance(self.assistant, str) and self.assistant):
            raise ValueError(f"a pair needs two non-empty identities, got {self.target!r}, {self.assistant!r}")

    @classmethod
    def of(cls, target: torch.nn.Module, assistant: object | None = None) -> PairKey:
        """The key of ``target`` with ``assistant_model`` (a draft model, a draft head, or None)."""
        return cls(hf_compat.weights_identity(target), assistant_identity(assistant))

    def cache_path(self) -> Path:
        """The pair's file in hf-adaspec's cache (``models.assets.cache_dir``): learned/<target>-<assistant>.json."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.target}-{self.assistant}")
        return cache_dir() / FOLDER / f"{safe}.json"


def learned_document(pair: PairKey, calibrators: CalibratorMemory, matches: MatchMemory) -> dict:
    """The JSON document of the learned counts (no digest yet): format, version, pair, counts by drafter key."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "library": versions("hf-adaspec")["hf-adaspec"],  # informative: which hf-adaspec wrote it
        "pair": {"target": pair.target, "assistant": pair.assistant},
        "calibrators": calibrators.counts(),
        "matches": matches.counts(),
    }


def write_learned(path: Path, pair: PairKey, calibrators: CalibratorMemory, matches: MatchMemory) -> None:
    """Write ``learned_document`` to ``path`` atomically with its digest (``files.write_json_verified``; the
    folder is made). Raises OSError (IsADirectoryError for a folder at ``path``) where it cannot be written."""
    write_json_verified(path, learned_document(pair, calibrators, matches))


def read_learned(path: Path, pair: PairKey, calibrators: CalibratorMemory, matches: MatchMemory) -> None:
    """Restore the counts saved at ``path`` for ``pair`` into ``calibrators`` and ``matches`` (fresh memories:
    a drafter key the file holds replaces theirs), all or nothing.

    Raises:
        FileNotFoundError: no file at ``path``.
        LearnedStateError: a file that is not an intact learned state (unreadable, not JSON, digest mismatch),
            of another format or version, saved for another pair, or with counts no learning reaches.
    """
    try:
        document = read_json_verified(path)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:
        raise LearnedStateError(f"{path} is not an intact learned state ({e}); delete it to start fresh") from None
    if document.get("format") != FORMAT or document.get("version") != VERSION:
        raise LearnedStateError(
            f"{path} is {document.get('format')!r} version {document.get('version')!r}, this hf-adaspec reads "
            f"{FORMAT!r} version {VERSION}; delete it to start fresh"
        )
    saved = document.get("pair")
    if saved != {"target": pair.target, "assistant": pair.assistant}:
        raise LearnedStateError(
            f"{path} was learned by another pair ({saved!r}), not target {pair.target} with assistant "
            f"{pair.assistant}; pass the models it was saved with, or start from a fresh SpeculationState()"
        )
    fresh_calibrators, fresh_matches = CalibratorMemory(calibrators.factory), MatchMemory(matches.factory)
    try:
        fresh_calibrators.restore(_mapping(document.get("calibrators")))
        fresh_matches.restore(_mapping(document.get("matches")))
    except ValueError as e:
        raise LearnedStateError(
            f"{path} holds counts this hf-adaspec refuses ({e}); delete it to start fresh"
        ) from None
    calibrators.restore(fresh_calibrators.counts())
    matches.restore(fresh_matches.counts())


def _mapping(value: object) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"expected an object of counts by drafter key, got {value!r:.80}")
    return value
