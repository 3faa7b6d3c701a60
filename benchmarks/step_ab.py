"""A q4 target's step through this package's step changes against their absence, and against itself (the A/A
spread), interleaved in one process: the model's forward ("model": ``model_calls.forward`` calling the model), the
flat forward with torch's SiLU·up ("flat, torch SwiGLU": ``hf_compat.flat_forward``, every ``GatedMLP`` taking
``forward``'s halves), and the flat forward with the kernel's SwiGLU ("flat", twice: ``Q4Linear.swiglu``).

Each variant times forwards over n new tokens on top of a ``--context``-token cache as the engine's calibration
times them (``costs.table.ForwardProbe``, the cache rolled back after each), with the speculative request's
attention swapped in. ``--rounds`` rounds rotate through the variants, ``--forwards`` timed forwards each (after 3
untimed); medians. Run it alone on the machine and name the processor beside its figures.

    python benchmarks/step_ab.py [--model qwen2.5-coder-1.5b] [--context 128] [--rounds 7] [--forwards 15]

Last line: one JSON object (per n: each variant's median ms; the processor, its flags, the q4 path).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from step_profile import _cpu_flags  # benchmarks/, on sys.path when this script runs

from hf_adaspec import enable
from hf_adaspec.backend import hf_compat
from hf_adaspec.backend.hf_compat import model_calls
from hf_adaspec.costs.table import ForwardProbe
from hf_adaspec.kernels import q4
from hf_adaspec.kernels.fused import GatedMLP
from hf_adaspec.kernels.q4_layer import Q4Linear
from hf_adaspec.machine import processor_name
from hf_adaspec.models.loading import load

FLAT = model_calls.flat_forward
VARIANTS = {  # name → (the forward model_calls uses, whether GatedMLP applies the kernel's SwiGLU)
    "model": (lambda *args: None, True),
    "flat, torch SwiGLU": (FLAT, False),
    "flat": (FLAT, True),
    "flat again": (FLAT, True),
}


def _round(probe: ForwardProbe, mlps: list[GatedMLP], n: int, forwards: int) -> dict[str, float]:
    """Each variant's median ms over ``forwards`` timed forwards of n tokens, in the rotation's order."""
    medians = {}
    for name, (flat, swiglu) in VARIANTS.items():
        model_calls.flat_forward = flat
        for mlp in mlps:
            mlp.silu = swiglu
        for _ in range(3):
            probe.time_ms(n, 1)
        medians[name] = statistics.median(probe.time_ms(n, 1) for _ in range(forwards))
    model_calls.flat_forward = FLAT
    return medians


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--forwards", type=int, default=15)
    ap.add_argument("--tokens", default="1,5", help="comma-separated n (new tokens per forward)")
    args = ap.parse_args()
    model = enable(load(args.model).model)
    linears = [m for m in model.modules() if isinstance(m, Q4Linear)]
    mlps = [m for m in model.modules() if isinstance(m, GatedMLP) and m.silu]
    tokens = [int(t) for t in args.tokens.split(",")]
    results = {}
    with torch.no_grad(), hf_compat.speculative_attention(hf_compat.AttentionSwap(model)):
        probe = ForwardProbe(model, args.context, max(tokens))
        for n in tokens:
            rounds = [_round(probe, mlps, n, args.forwards) for _ in range(args.rounds)]
            ms = {name: round(statistics.median(r[name] for r in rounds), 2) for name in VARIANTS}
            results[n] = {**ms, "flat/model": round(ms["flat"] / ms["model"], 3)}
            print(f"n={n}: " + ", ".join(f"{k} {v}" for k, v in results[n].items()), flush=True)
    print(
        json.dumps(
            {
                "model": args.model,
                "context": args.context,
                "ms": results,
                "rounds": args.rounds,
                "forwards": args.forwards,
                "threads": torch.get_num_threads(),
                "q4_path": q4.path(linears[0].directory) if linears else None,
                "processor": processor_name(),
                "cpu_flags": _cpu_flags(),
            }
        )
    )


if __name__ == "__main__":
    main()
