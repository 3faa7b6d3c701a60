"""Files the library writes and later trusts: atomic writes, verified stamps, and what a killed writer left.

Design: every cache entry (assembled GGUF, dense safetensors folder, cost table, profile) is written
beside its final path under a temporary name ``<name>.tmp-<pid>-<random>`` (a file or a folder), then
renamed into place, so no reader ever sees half an entry. A writer killed mid-way leaves its temporary
behind under that name; ``sweep`` removes the ones whose writing process is gone and keeps those of a
process still writing. What was written is recorded in a stamp — per file its size, SHA-256 and the
mtime at which it was hashed — and ``check_files`` trusts an entry only while every file matches it:
a file whose size differs fails at once; one whose mtime changed is hashed again (so a check costs a
``stat`` per file until something touches the file). That cheap check misses bytes changed with size and
mtime kept (bit rot, a backup restored with its timestamps): ``full=True`` hashes every file (what
``hf-adaspec check-files`` and ``load(..., verify=True)`` do). JSON documents carry their own ``digest`` (the
SHA-256 of the rest of the document), checked in full at every read (``read_json_verified``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

TMP_MARK = ".tmp-"
_TMP_RE = re.compile(re.escape(TMP_MARK) + r"(\d+)-[0-9a-f]+$")
_CHUNK = 8 << 20
DIGEST = "digest"


def temp_path(dest: Path) -> Path:
    """A fresh temporary name beside ``dest``, findable by ``sweep``: ``<name>.tmp-<pid>-<random>``."""
    return dest.with_name(f"{dest.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep(folder: Path) -> list[Path]:
    """Remove the temporaries in ``folder`` left by writers that no longer run; returns what was removed.
    Temporaries of live processes (this one included) are kept: they may still be writing."""
    removed = []
    if not folder.is_dir():
        return removed
    for entry in folder.iterdir():
        match = _TMP_RE.search(entry.name)
        if match is None or _alive(int(match.group(1))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Create ``path`` (and its folder) from ``write(file)``: written and fsynced under ``temp_path``, then
    renamed into place; the temporary is removed on error (and by ``sweep`` after a kill).

    Raises:
        IsADirectoryError: ``path`` is a directory (the message names it and the fix).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory where a file belongs; remove it (rm -r {path})")
    tmp = temp_path(path)
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_dir(dest: Path) -> Iterator[Path]:
    """``with atomic_dir(dest) as tmp:`` fill the folder ``tmp``; on success it replaces ``dest`` (an
    existing ``dest`` is removed first), on error it is removed (and by ``sweep`` after a kill)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(dest)
    tmp.mkdir()
    try:
        yield tmp
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class FileStamp:
    """What was written to one file: its size (bytes), SHA-256 and the mtime (ns) when it was hashed."""

    name: str
    size: int
    sha256: str
    mtime_ns: int

    @classmethod
    def of(cls, path: Path, sha256: str | None = None) -> FileStamp:
        """Stamp ``path`` as it is now (``sha256``: its already computed hash, to skip re-reading it)."""
        stat = path.stat()
        return cls(path.name, stat.st_size, sha256 or sha256_file(path), stat.st_mtime_ns)


def file_problem(path: Path, stamp: FileStamp, full: bool = False) -> str | None:
    """Why ``path`` is not the file ``stamp`` records (missing, other size, other SHA-256), or None.
    Hashes only when the mtime moved since the stamp, or always with ``full``."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return f"{path.name} is missing"
    if stat.st_size != stamp.size:
        return f"{path.name} has {stat.st_size:,} bytes, {stamp.size:,} were written"
    if (full or stat.st_mtime_ns != stamp.mtime_ns) and sha256_file(path) != stamp.sha256:
        return f"{path.name} was modified after it was written (SHA-256 differs)"
    return None


def write_stamp(path: Path, stamps: list[FileStamp]) -> None:
    """Record ``stamps`` as the JSON stamp file ``path`` (atomically)."""
    document = {"files": [asdict(s) for s in stamps]}
    atomic_write(path, lambda f: f.write(json.dumps(document, indent=1).encode()))


def read_stamp(path: Path) -> list[FileStamp] | None:
    """The stamps recorded at ``path``, or None when it is missing or not a stamp of this format."""
    try:
        return [FileStamp(**s) for s in json.loads(path.read_text())["files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_files(folder: Path, stamp_path: Path, full: bool = False) -> str | None:
    """None when every file recorded in ``stamp_path`` matches it inside ``folder``, else the reason;
    ``full``: hash every file (``file_problem``), not only those whose mtime moved."""
    stamps = read_stamp(stamp_path)
    if stamps is None:
        return f"{stamp_path.name} is missing or unreadable (an interrupted or older write)"
    for stamp in stamps:
        problem = file_problem(folder / stamp.name, stamp, full)
        if problem:
            return problem
    return None


def _digest(document: dict) -> str:
    body = {k: v for k, v in document.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def write_json_verified(path: Path, document: dict) -> None:
    """Write ``document`` as JSON atomically with a ``digest`` field: the SHA-256 of the rest of it."""
    text = json.dumps({**document, DIGEST: _digest(document)}, indent=2) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


def read_json_verified(path: Path) -> dict:
    """The JSON document at ``path`` without its digest, after checking the digest.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: not JSON, not an object, no digest, or a digest that does not match (edited by hand,
            or corrupted); OSError for an unreadable path (e.g. a directory).
    """
    document = json.loads(path.read_text())
    if not isinstance(document, dict):
        raise ValueError("not a JSON object")
    if DIGEST not in document:
        raise ValueError("it has no digest (written by an older version, or by hand)")
    if document[DIGEST] != _digest(document):
        raise ValueError("its digest does not match its contents (edited by hand, or corrupted)")
    return {k: v for k, v in document.items() if k != DIGEST}
