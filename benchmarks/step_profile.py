"""Where a q4 target's 1-token step goes: the q4 kernel's time per matrix shape (ms, GB/s of weight blocks read)
against everything else in the forward (norms, RoPE, attention, the cache, residuals, Python and module calls).

The step is timed as the engine's calibration times it (``costs.table.ForwardProbe``: a forward over one new token
on top of a ``--context``-token cache, rolled back after each), with the speculative request's attention swapped in
(``hf_compat.AttentionSwap``), on the model ``quantization="auto"`` loads. Rounds alternate between forwards without
hooks (the step's time) and forwards with a timer around every ``Q4Linear`` call (the kernel's share); the rest is
the step's median less the kernel's. Run it alone on the machine; name the processor beside its figures.

    python benchmarks/step_profile.py [--model qwen2.5-coder-1.5b] [--context 128] [--rounds 5] [--forwards 20]

Last line: one JSON object (per shape: calls per step, ms per step, GB/s; the step, the kernel's and the rest's ms;
the processor, its flags and the kernel's path).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch

from hf_adaspec import enable
from hf_adaspec.backend import hf_compat
from hf_adaspec.backend.hf_compat import flat_forward
from hf_adaspec.costs.table import ForwardProbe
from hf_adaspec.kernels import q4
from hf_adaspec.kernels.q4_layer import Q4Linear
from hf_adaspec.machine import processor_name
from hf_adaspec.models.loading import load


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(line for line in f if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return sorted(f for f in line.split(":")[1].split() if f.startswith(("avx", "amx", "fma", "f16c")))


def _shape(module: Q4Linear) -> str:
    return f"{module.out_features}x{module.in_features} {'+'.join(module.kinds)}"


def _timed(probe: ForwardProbe, forwards: int) -> list[float]:
    return [probe.time_ms(1, 1) for _ in range(forwards)]


def _kernel_round(probe: ForwardProbe, forwards: int) -> dict[str, list[float]]:
    """ms per step spent in each shape's kernel calls (``q4_linear`` and ``q4_swiglu``), over ``forwards`` timed
    forwards (the class's ``_kernel`` wrapped: the flat forward calls the layers directly, without their hooks; its
    decoder stack, which calls the kernel from C, is set aside for the round)."""
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    kernel = Q4Linear._kernel

    def timed(module: Q4Linear, x: torch.Tensor, function: str, width: int) -> torch.Tensor | None:
        start = time.perf_counter()
        y = kernel(module, x, function, width)
        key = f"{_shape(module)} {function}"
        spent[key] += (time.perf_counter() - start) * 1000.0
        calls[key] += 1
        return y

    Q4Linear._kernel = timed
    plan = flat_forward._plan(probe.model)
    stack = plan.stack if plan is not None else None
    if stack is not None:
        object.__setattr__(plan, "stack", None)
    try:
        _timed(probe, forwards)
    finally:
        Q4Linear._kernel = kernel
        if stack is not None:
            object.__setattr__(plan, "stack", stack)
    return {k: [spent[k] / forwards, calls[k] / forwards] for k in spent}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--forwards", type=int, default=20)
    args = ap.parse_args()
    model = enable(load(args.model).model)
    linears = [m for m in model.modules() if isinstance(m, Q4Linear)]
    if not linears:
        raise SystemExit(f"{args.model} loaded without q4 layers: this profile is of the q4 kernel's step")
    bytes_of = {f"{_shape(m)} {f}": m.blocks.numel() for m in linears for f in ("q4_linear", "q4_swiglu")}
    swap = hf_compat.AttentionSwap(model)
    steps: list[float] = []
    kernel: dict[str, list[list[float]]] = defaultdict(list)
    with torch.no_grad(), hf_compat.speculative_attention(swap):
        probe = ForwardProbe(model, args.context, 1)
        _timed(probe, args.forwards)  # warm-up
        for _ in range(args.rounds):
            steps += _timed(probe, args.forwards)
            for key, value in _kernel_round(probe, args.forwards).items():
                kernel[key].append(value)
    step_ms = statistics.median(steps)
    shapes = {}
    for key, rounds in sorted(kernel.items(), key=lambda kv: -statistics.median(r[0] for r in kv[1])):
        ms, calls = statistics.median(r[0] for r in rounds), rounds[0][1]
        shapes[key] = {
            "calls_per_step": calls,
            "ms_per_step": round(ms, 3),
            "gb_per_s": round(bytes_of[key] * calls / (ms / 1000.0) / 1e9, 1),
        }
        print(f"{key:42s} {calls:4.0f} calls {ms:8.2f} ms {shapes[key]['gb_per_s']:7.1f} GB/s", flush=True)
    kernel_ms = sum(s["ms_per_step"] for s in shapes.values())
    print(f"step {step_ms:.2f} ms: q4 kernel {kernel_ms:.2f} ms, the rest {step_ms - kernel_ms:.2f} ms", flush=True)
    print(
        json.dumps(
            {
                "model": args.model,
                "context": args.context,
                "step_ms": round(step_ms, 3),
                "kernel_ms": round(kernel_ms, 3),
                "rest_ms": round(step_ms - kernel_ms, 3),
                "shapes": shapes,
                "rounds": args.rounds,
                "forwards": args.forwards,
                "threads": torch.get_num_threads(),
                "q4_path": q4.path(linears[0].directory),
                "processor": processor_name(),
                "cpu_flags": _cpu_flags(),
            }
        )
    )


if __name__ == "__main__":
    main()
