"""Compiling a C source of this package into a shared library on first use, with the machine's C compiler.

Design: ``build`` names the library ``<directory>/<stem>-<hash>.so`` after the source, the headers beside it that
it includes (``#include "name.h"``), the compiler and the flags, so an edited source or header or another compiler
builds anew and an unchanged one is reused; the library is written under
a temporary name and renamed (a crash leaves no half-written library; ``files.sweep`` removes the leftovers).
``KernelUnavailable`` says why a kernel cannot be built here (no compiler, a failed build) and names the fix.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path

FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-std=c11")  # OpenMP: the kernels share torch's runtime
LOCAL_INCLUDE = re.compile(rb'^#include "([^"/]+)"', re.MULTILINE)  # a header beside the source


class KernelUnavailable(RuntimeError):
    """A kernel of this package cannot be built or run on this machine; the message names the fix."""


def compiler() -> str:
    """``$CC`` if set, else ``cc`` or ``gcc``: its path. Raises KernelUnavailable when there is none."""
    wanted = os.environ.get("CC")
    cc = shutil.which(wanted) if wanted else (shutil.which("cc") or shutil.which("gcc"))
    if not cc:
        what = f"$CC={wanted}" if wanted else "no C compiler"
        raise KernelUnavailable(
            f"the package's C kernels are compiled on first use and {what} was not found: "
            "install one (Debian/Ubuntu: apt install gcc) or set $CC to it"
        )
    return cc


def build(source: Path, directory: Path) -> Path:
    """The shared library of ``source`` (a ``.c`` file) in ``directory``, compiled now with ``FLAGS`` unless a build
    of this source, its local headers, compiler and flags is there. Raises KernelUnavailable: no C compiler, or the
    compiler failed (its message)."""
    cc = compiler()
    text = source.read_bytes()
    headers = b"".join((source.parent / name.decode()).read_bytes() for name in LOCAL_INCLUDE.findall(text))
    tag = hashlib.sha256(text + headers + " ".join((cc, *FLAGS)).encode()).hexdigest()[:16]
    path = Path(directory) / f"{source.stem}-{tag}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")  # files.sweep's pattern
    done = subprocess.run([cc, *FLAGS, str(source), "-o", str(tmp), "-lm"], capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise KernelUnavailable(f"{cc} could not build {source.name}: {done.stderr.strip()[-400:]}")
    os.replace(tmp, path)
    return path
