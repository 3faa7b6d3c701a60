"""Each step of the GPU check in a process of its own, and what a run ran on.

A step that breaks the process's CUDA state must not take the later steps with it: on 2026-11-28 one failed graph
capture left the caching allocator recording into its pool and the CUDA generator in capture mode, and every later
step failed on that. On a GPU each step runs as ``python -m hf_adaspec.gpu_check --child --steps NAME``, which
merges its entry into the results file (the facts later steps use are read back from there,
``gpu_check.carried_facts``); a process that dies before recording its step, or overruns the budget, is recorded as
that step's error. ``provenance``: the commit (``HF_ADASPEC_COMMIT``, else git's HEAD), torch, CUDA, the driver,
transformers and Python.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers

COMMIT_ENV = "HF_ADASPEC_COMMIT"  # the commit a checkout without .git (a lent GPU machine's copy) was made from
GRACE_S = 60.0  # a step's process may overrun the budget it was given by this much before it is stopped
_ROOT = Path(__file__).resolve().parents[2]


def _output(command: list[str]) -> str | None:
    """``command``'s stdout, stripped; None where it cannot run or fails."""
    try:
        return subprocess.run(command, capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def commit() -> str | None:
    """The code's commit: ``$HF_ADASPEC_COMMIT``, else git's HEAD of this checkout (" with uncommitted changes"
    where tracked files differ from it), else None."""
    if os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    head = _output(["git", "-C", str(_ROOT), "rev-parse", "HEAD"])
    if not head:
        return None
    changed = _output(["git", "-C", str(_ROOT), "status", "--porcelain", "--untracked-files=no"])
    return head + (" with uncommitted changes" if changed else "")


def provenance() -> dict:
    """What a run's results depend on besides the code's own choices: commit, torch, CUDA (None: a CPU build),
    the NVIDIA driver (``nvidia-smi``; None without one), transformers and Python versions."""
    driver = _output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {
        "commit": commit(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": driver.splitlines()[0] if driver else None,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def child_command(device: str, out: Path, name: str, budget_s: float, kv_cache: str, tiny: bool) -> list[str]:
    """The command that runs step ``name`` alone and merges its entry into ``out``'s results."""
    return [
        sys.executable,
        "-m",
        "hf_adaspec.gpu_check",
        "--child",
        "--device",
        device,
        "--out",
        str(out),
        "--steps",
        name,
        "--budget-s",
        f"{budget_s:.1f}",
        "--kv-cache",
        kv_cache,
        *(["--tiny"] if tiny else []),
    ]


def run_in_child(command: list[str], results: Path, name: str, budget_s: float) -> dict:
    """Run ``command`` (``child_command``; its output goes to this process's) → the entry it recorded for step
    ``name`` in ``results``, or an error entry where the process overran ``budget_s`` + ``GRACE_S`` (it is
    stopped) or exited without recording one."""
    start = time.perf_counter()
    try:
        status = subprocess.run(command, timeout=budget_s + GRACE_S).returncode
    except subprocess.TimeoutExpired:
        return {
            "status": "error",
            "seconds": round(time.perf_counter() - start, 1),
            "error": f"the step's process ran past its budget ({budget_s + GRACE_S:.0f} s) and was stopped",
        }
    entry = json.loads(results.read_text())["steps"].get(name) if results.is_file() else None
    if entry is None:
        return {
            "status": "error",
            "seconds": round(time.perf_counter() - start, 1),
            "error": f"the step's process exited with status {status} without recording the step",
        }
    return entry
