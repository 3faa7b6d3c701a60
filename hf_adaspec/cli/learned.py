"""The pair's learned state for ``hf-adaspec generate``: read before the request, written after it.

Design: each ``generate`` is a new process, so without a file every run would start the pair's acceptance from
its prior. By default the pair's file in hf-adaspec's cache (``engine.persist.PairKey.cache_path``, one per
target and assistant weights) is read, and written back with what the request learned: counts only
(``SpeculationState.save``), never the prompt or the answer. A default file that is damaged or stale is
ignored with one line and replaced; a file the user named (``--learned-state``) that cannot be used is a usage
error naming the fix. ``--fresh`` starts from nothing learned and neither reads nor writes a file. Benchmarks
never come here: they build a fresh ``SpeculationState`` per method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import typer

from ..engine.persist import LearnedStateError, PairKey
from ..engine.run import SpeculationState


@dataclass(frozen=True)
class PairState:
    """The state a ``generate`` request learns into, the file it is written back to (None: not written) and
    whether the user named that file (``--learned-state``)."""

    state: SpeculationState
    path: Path | None
    named: bool = False


def open_state(
    target: torch.nn.Module,
    assistant: object | None,
    path: Path | None,
    fresh: bool,
    echo: Callable[[str], None],
) -> PairState:
    """The request's state: fresh with ``fresh``; else loaded from ``path`` (default: the pair's cache file) when
    there is one. A default file that cannot be used is reported by one ``echo`` line and replaced after.

    Raises:
        typer.BadParameter: ``path`` was given and holds a file that cannot be used (the message names the fix).
    """
    if fresh:
        return PairState(SpeculationState(), None)
    named = path is not None
    path = path if named else PairKey.of(target, assistant).cache_path()
    if not path.exists():
        return PairState(SpeculationState(), path, named)
    try:
        return PairState(SpeculationState.load(path, target, assistant), path, named)
    except (LearnedStateError, OSError) as e:
        if named:
            raise typer.BadParameter(f"--learned-state: {e} (or run with --fresh)") from None
        echo(f"[hf-adaspec] starting fresh, the pair's learned state is not usable: {e}")
        return PairState(SpeculationState(), path)


def keep_state(
    opened: PairState, target: torch.nn.Module, assistant: object | None, echo: Callable[[str], None]
) -> None:
    """Write what the request learned back to its file (none with ``--fresh``); where the default file cannot be
    written, one ``echo`` line says so.

    Raises:
        typer.BadParameter: the file the user named cannot be written (e.g. a folder at ``--learned-state``).
    """
    if opened.path is None:
        return
    try:
        opened.state.save(opened.path, target, assistant)
    except OSError as e:
        if opened.named:
            raise typer.BadParameter(f"--learned-state {opened.path} cannot be written: {e}") from None
        echo(f"[hf-adaspec] the pair's learned state was not saved: {e}")
