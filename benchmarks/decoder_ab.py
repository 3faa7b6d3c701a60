"""A q4 target's step through the decoder stack as one C call (``kernels.decoder``) against the flat forward's
layer loop as it was before the stack (one module call at a time, torch's SDPA: ``attention.packed_gqa``), and
against itself (the A/A spread), interleaved in one process; the loop with the C attention shows the two parts
apart.

Each variant times forwards over n new tokens (``--widths``) on top of a ``--context``-token cache as the engine's
calibration times them (``costs.table.ForwardProbe``, the cache rolled back after each), with the speculative
request's attention swapped in, on the model ``quantization="auto"`` loads. Each round rotates through the
variants: ``--forwards`` timed forwards each, after 2 untimed; medians over the rounds. Run it alone on the machine
and name the processor beside its figures.

    python benchmarks/decoder_ab.py [--model qwen2.5-coder-1.5b] [--contexts 128,1024] [--widths 1,5] [--rounds 5]
        [--forwards 10]

Last line: one JSON object (per context and width: each variant's median ms; the processor, its flags, the q4 path).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from step_profile import _cpu_flags  # benchmarks/, on sys.path when this script runs

import hf_adaspec
from hf_adaspec.backend import hf_compat
from hf_adaspec.backend.attention import packed_gqa
from hf_adaspec.backend.hf_compat import flat_forward
from hf_adaspec.costs.table import ForwardProbe
from hf_adaspec.kernels import layer_ops, q4
from hf_adaspec.kernels.q4_layer import Q4Linear
from hf_adaspec.machine import processor_name

VARIANTS = ("before: loop, SDPA", "loop, C attention", "stack", "stack again")


def _sdpa(query, keys, values, held, scale, directory):
    """The loop's attention before the stack: ``packed_gqa`` over the block's columns with the causal mask."""
    n = query.shape[2]
    mask = None if n == 1 else (torch.arange(held + n) <= torch.arange(held, held + n)[:, None])[None, None]
    return packed_gqa(query, keys[:, :, : held + n], values[:, :, : held + n], mask, scale)


class _Variant:
    """Sets the flat forward up as one variant: the plan's stack kept or not, the loop's attention C or SDPA."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.plan = model, flat_forward._plan(model)
        if self.plan is None or self.plan.stack is None:
            raise SystemExit("the model's steps do not run as one decoder stack here: nothing to compare")
        self.stack, self.attention = self.plan.stack, layer_ops.attention

    def set(self, variant: str) -> None:
        object.__setattr__(self.plan, "stack", self.stack if variant.startswith("stack") else None)
        layer_ops.attention = _sdpa if variant.startswith("before") else self.attention


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--contexts", default="128,1024")
    ap.add_argument("--widths", default="1,5")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--forwards", type=int, default=10)
    args = ap.parse_args()
    model = hf_adaspec.load(args.model).model
    widths = [int(w) for w in args.widths.split(",")]
    variant = _Variant(model)
    out: dict[str, dict] = {}
    with torch.no_grad(), hf_compat.speculative_attention(hf_compat.AttentionSwap(model)):
        for context in (int(c) for c in args.contexts.split(",")):
            probe = ForwardProbe(model, context, max(widths))
            for n in widths:
                ms: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for _ in range(args.rounds):
                    for v in VARIANTS:
                        variant.set(v)
                        for _ in range(2):
                            probe.time_ms(n, 1)
                        ms[v].append(statistics.median(probe.time_ms(n, 1) for _ in range(args.forwards)))
                out[f"context {context}, {n} tokens"] = row = {v: round(statistics.median(t), 2) for v, t in ms.items()}
                print(context, n, row, flush=True)
    variant.set("stack")
    directory = next(m for m in model.modules() if isinstance(m, Q4Linear)).directory
    print(
        json.dumps(
            {
                "model": args.model,
                "ms": out,
                "rounds": args.rounds,
                "forwards": args.forwards,
                "threads": torch.get_num_threads(),
                "q4_path": q4.path(directory),
                "processor": processor_name(),
                "cpu_flags": _cpu_flags(),
            }
        )
    )


if __name__ == "__main__":
    main()
