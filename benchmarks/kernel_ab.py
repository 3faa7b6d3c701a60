"""Two builds of the q4 kernel (``hf_adaspec/kernels/q4.c``) in one process: a base commit's and this checkout's,
interleaved, on the pair's steps, with the base timed twice (the A/A spread).

Each model (``--models``, loaded as ``hf_adaspec.load`` loads them) times forwards over n new tokens (``--widths``)
on top of a ``--context``-token cache as the engine's calibration times them (``costs.table.ForwardProbe``, the
cache rolled back after each), with the speculative request's attention swapped in. Each round rotates through
base, this checkout, base again; a variant's layers rebind their kernel calls to its library (``Q4Linear._bound``
cleared). The base's source is built with this checkout's compiler flags into a temporary folder; its entry points
must take the same arguments as this checkout's. Run it alone on the machine; name the processor beside its figures.

    python benchmarks/kernel_ab.py --base 74df1df [--models qwen2.5-coder-1.5b,qwen2.5-coder-0.5b] [--context 128]
        [--widths 1,5] [--rounds 9] [--forwards 12] [--neighbour 0.3]

``--neighbour D`` runs another process beside the timing that keeps one core busy a fraction D of each 10 ms (a
shared host: another tenant, a browser), so both builds are timed under the same load; there the mean per round
(the time a generation takes) is reported beside the median.

Last line: one JSON object (per model and width: each variant's median ms, and its mean ms; the processor, its
flags, the q4 path).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch
from neighbour import neighbour  # benchmarks/, on sys.path when this script runs
from step_profile import _cpu_flags

from hf_adaspec import enable
from hf_adaspec.backend import hf_compat
from hf_adaspec.costs.table import ForwardProbe
from hf_adaspec.kernels import cbuild, q4
from hf_adaspec.kernels.q4_layer import Q4Linear
from hf_adaspec.machine import processor_name
from hf_adaspec.models.loading import load

ENTRIES = ("q4_linear", "q4_swiglu", "q4_dequantize", "q4_from_gguf")
SOURCE = "hf_adaspec/kernels/q4.c"


def base_library(base: str, folder: Path, current: ctypes.CDLL) -> ctypes.CDLL:
    """The base commit's q4.c (and the headers beside it that it includes) built in ``folder``, its entries typed as
    ``current``'s. Raises SystemExit where the base's blocks are laid out otherwise (its results would not be this
    checkout's)."""
    source = folder / "q4.c"
    source.write_bytes(subprocess.run(["git", "show", f"{base}:{SOURCE}"], capture_output=True, check=True).stdout)
    for header in cbuild.LOCAL_INCLUDE.findall(source.read_bytes()):
        path = f"{Path(SOURCE).parent}/{header.decode()}"
        (folder / header.decode()).write_bytes(
            subprocess.run(["git", "show", f"{base}:{path}"], capture_output=True, check=True).stdout
        )
    lib = ctypes.CDLL(str(cbuild.build(source, folder)))
    for name in ENTRIES:
        getattr(lib, name).argtypes = getattr(current, name).argtypes
    if [lib.q4_block_bytes(i) for i in range(-1, 3)] != [current.q4_block_bytes(i) for i in range(-1, 3)]:
        raise SystemExit(f"{base}'s q4.c lays its blocks out otherwise: the builds are not comparable")
    return lib


def use(lib: ctypes.CDLL, model: torch.nn.Module) -> None:
    """``model``'s q4 layers call ``lib`` from their next product on."""
    q4.library = lambda directory: lib
    for module in model.modules():
        if isinstance(module, Q4Linear):
            module._bound.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the commit whose q4.c is the A side")
    ap.add_argument("--models", default="qwen2.5-coder-1.5b,qwen2.5-coder-0.5b")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--widths", default="1,5")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--forwards", type=int, default=12)
    ap.add_argument("--neighbour", type=float, default=0.0, help="a busy process's share of one core (0: none)")
    args = ap.parse_args()
    if not 0 <= args.neighbour < 1:
        raise SystemExit("--neighbour: a share of one core in [0, 1)")
    widths = [int(w) for w in args.widths.split(",")]
    models = {name: enable(load(name).model) for name in args.models.split(",")}
    first = next(m for m in next(iter(models.values())).modules() if isinstance(m, Q4Linear))
    current = q4.library(first.directory)
    results: dict[str, dict[str, list[float]]] = {}
    means: dict[str, dict[str, list[float]]] = {}
    other = multiprocessing.Process(target=neighbour, args=(args.neighbour,), daemon=True)
    if args.neighbour:
        other.start()
    with tempfile.TemporaryDirectory() as folder, torch.no_grad():
        base = base_library(args.base, Path(folder), current)
        variants = {"base": base, "checkout": current, "base again": base}
        for name, model in models.items():
            with hf_compat.speculative_attention(hf_compat.AttentionSwap(model)):
                probe = ForwardProbe(model, args.context, max(widths))
                for _ in range(args.rounds):
                    for variant, lib in variants.items():
                        use(lib, model)
                        for n in widths:
                            for _ in range(3):
                                probe.time_ms(n, 1)
                            times = [probe.time_ms(n, 1) for _ in range(args.forwards)]
                            results.setdefault(f"{name} n={n}", {}).setdefault(variant, []).append(
                                statistics.median(times)
                            )
                            means.setdefault(f"{name} n={n}", {}).setdefault(variant, []).append(
                                statistics.fmean(times)
                            )
            use(current, model)
    if args.neighbour:
        other.kill()
    table = {key: {v: round(statistics.median(t), 3) for v, t in row.items()} for key, row in results.items()}
    mean = {key: {v: round(statistics.median(t), 3) for v, t in row.items()} for key, row in means.items()}
    for key, row in table.items():
        print(f"{key:28s} " + "  ".join(f"{v} {ms:8.3f} (mean {mean[key][v]:8.3f})" for v, ms in row.items()))
    print(
        json.dumps(
            {
                "base": args.base,
                "context": args.context,
                "rounds": args.rounds,
                "forwards": args.forwards,
                "ms": table,
                "mean_ms": mean,
                "neighbour": args.neighbour,
                "threads": torch.get_num_threads(),
                "q4_path": q4.path(first.directory),
                "processor": processor_name(),
                "cpu_flags": _cpu_flags(),
            }
        )
    )


if __name__ == "__main__":
    main()
