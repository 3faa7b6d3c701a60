"""``hf-adaspec check-files``: a full check of every entry in hf-adaspec's cache, each failure with its fix.

Design: a load trusts a cache entry by a cheap check (per file its size, and its SHA-256 again only when
its mtime moved: ``files.check_files``), which misses bytes changed with size and mtime kept (bit rot, a
backup restored with its timestamps). This walks the cache (``$HF_ADASPEC_CACHE`` or
``~/.cache/hf-adaspec``) and checks every entry in full: assembled GGUF files (``gguf/``) and dense model
folders (``dense/``) by every file's SHA-256 against their stamps, cost tables (``costs/``) and profiles
(``profiles/``) by their digests and values, as every use reads them. Temporaries of writers
(``<name>.tmp-<pid>-<random>``) are not entries (the next load removes those of dead writers), nor are
the ``.stamp`` sidecars (checked with their file). Registered on the CLI's app by ``cli``, with ``verify``,
the command's old name, as a hidden alias for one release ("verify" reads as speculative verification).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import typer

from ..costs.cache import TABLE_ERRORS, read_table
from ..costs.profile_files import load_profile
from ..files import TMP_MARK
from ..models.assets import cache_dir, check_assembled
from ..models.loading import check_dense
from ..models.presets import PRESETS

KINDS = ("gguf", "dense", "costs", "profiles")  # the cache's folders, each a kind of entry


@dataclass(frozen=True)
class EntryCheck:
    """One cache entry's full check: ``kind`` (one of ``KINDS``), its path, and when it failed, why
    (``problem``) and what fixes it (``fix``); both None when it is intact."""

    kind: str
    path: Path
    problem: str | None = None
    fix: str | None = None

    @property
    def ok(self) -> bool:
        return self.problem is None

    def line(self) -> str:
        """One line: ``ok <kind> <path>``, or ``FAILED <kind> <path>: <problem>; fix: <fix>``."""
        if self.ok:
            return f"ok      {self.kind:<8} {self.path}"
        return f"FAILED  {self.kind:<8} {self.path}: {self.problem}; fix: {self.fix}"


def entries(root: Path) -> Iterator[tuple[str, Path]]:
    """(kind, path) of every entry under ``root``, by kind in ``KINDS`` order, then by name."""
    for kind in KINDS:
        folder = root / kind
        if not folder.is_dir():
            continue
        for path in sorted(folder.iterdir()):
            if TMP_MARK in path.name or (kind == "gguf" and path.name.endswith(".stamp")):
                continue
            if kind in ("costs", "profiles") and path.suffix != ".json":
                continue
            yield kind, path


def _profile_command(path: Path) -> str:
    """The command that measured the profile at ``path``, if its JSON still says; else the plain command."""
    try:
        command = json.loads(path.read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        command = None
    return command if isinstance(command, str) and command.startswith("hf-adaspec profile") else "hf-adaspec profile"


def check_entry(kind: str, path: Path) -> EntryCheck:
    """Check one entry in full (``kind`` one of ``KINDS``): every byte of it is read."""
    problem: str | None = None
    if kind == "gguf":
        known = {p.asset.filename: p.asset.sha256 for p in PRESETS.values()}
        problem = check_assembled(path, known.get(path.name), full=True)
        fix = f"delete it (rm {path} {path}.stamp): the next load assembles it again from the installed parts"
    elif kind == "dense":
        problem = check_dense(path, full=True)
        fix = f"delete it (rm -r {path}): the next load of its model rebuilds it"
    elif kind == "costs":
        try:
            read_table(path)
        except TABLE_ERRORS as e:
            problem = f"not a valid cost table ({e})"
        fix = f"delete it (rm {path}): the next use calibrates the pair again"
    else:
        try:
            load_profile(path)
        except ValueError as e:
            problem = str(e)
        fix = f"delete it (rm {path}; until then the engine calibrates instead), then re-run `{_profile_command(path)}`"
    return EntryCheck(kind, path, problem, fix if problem else None)


def check_cache(root: Path, on_entry: Callable[[EntryCheck], None] | None = None) -> list[EntryCheck]:
    """Check every entry under ``root`` in full (``check_entry``), calling ``on_entry`` after each."""
    checks = []
    for kind, path in entries(root):
        checks.append(check_entry(kind, path))
        if on_entry is not None:
            on_entry(checks[-1])
    return checks


CACHE_OPTION = typer.Option(None, help="Cache folder (default: $HF_ADASPEC_CACHE or ~/.cache/hf-adaspec).")
RENAMED = "hf-adaspec verify is now hf-adaspec check-files; the old name goes in the next release"


def check_files(cache: Path | None = CACHE_OPTION) -> None:
    """Check every cache entry in full (the SHA-256 of every model file, the digest of every cost table and
    profile); one line per entry, a failed one with its fix. Exit code 1 when any failed; last stdout line: JSON."""
    root = cache or cache_dir()
    if root.exists() and not root.is_dir():
        raise typer.BadParameter(f"{root} is a file, not a cache folder; give the folder with --cache")
    if not root.is_dir():
        typer.echo(f"no cache at {root}: nothing to check (it is filled at the first load)")
    checks = check_cache(root, lambda check: typer.echo(check.line())) if root.is_dir() else []
    failed = [c for c in checks if not c.ok]
    typer.echo(
        json.dumps(
            {
                "cache": str(root),
                "entries": len(checks),
                "ok": len(checks) - len(failed),
                "failed": [{**asdict(c), "path": str(c.path)} for c in failed],
            }
        )
    )
    if failed:
        raise typer.Exit(1)


def verify(cache: Path | None = CACHE_OPTION) -> None:
    """The old name of check-files, kept for one release: says so on stderr, then runs it."""
    typer.echo(RENAMED, err=True)
    check_files(cache)
