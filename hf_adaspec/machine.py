"""What a measured time depends on besides the models: the processor, the kernels torch dispatches to and the
installed library versions. Keys of cached measurements (cost tables, profiles, weight-format choices) are
built from these; no decision reads a CPU flag."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
from pathlib import Path


@functools.cache
def processor_name() -> str:
    """This machine's CPU model (``/proc/cpuinfo``'s model name, else ``platform.processor()``), read once."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions(*dists: str) -> dict[str, str | None]:
    """Installed version of each distribution in ``dists`` (None when not installed), read once per process (a
    request's cost key asks every time; the process keeps the modules it imported)."""
    return {dist: _version(dist) for dist in dists}


@functools.cache
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
