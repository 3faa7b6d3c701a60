"""A q4 model's prefill with and without the dense route (issue 56): one forward over T random tokens (no cache),
every q4 layer on the kernel, then every q4 layer through dense weights (``kernels.route``), interleaved, medians;
and the route's start this machine chose (``models.route_choice``). Also whether the two give the same last-position
argmax, and their largest logit difference there. Run from the project root:

    python benchmarks/prefill_route.py --rounds 3 --output benchmarks/results/prefill_route_xeon.json

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hf_adaspec import load
from hf_adaspec.kernels import route
from hf_adaspec.machine import processor_name
from hf_adaspec.models.presets import DEFAULT_TARGET


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default=DEFAULT_TARGET)
    parser.add_argument("--lengths", default="64,128,256,512")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    model = load(args.target, quantization="q4", dtype="bfloat16").model
    chosen = route.largest(model).dense_rows
    gen, rows = torch.Generator().manual_seed(0), []
    for length in map(int, args.lengths.split(",")):
        ids = torch.randint(1000, (1, length), generator=gen)  # [1, T]
        ms, last = {"kernel": [], "dense": []}, {}
        for _ in range(args.rounds):
            for way, start in (("kernel", None), ("dense", length)):  # the head reads 1 row: kernel
                route.set_rows(model, start)
                with torch.inference_mode():
                    begin = time.perf_counter()
                    logits = model(ids, logits_to_keep=1).logits[0, -1].float()  # [V]
                    ms[way].append((time.perf_counter() - begin) * 1e3)
                last[way] = logits
        kernel, dense = statistics.median(ms["kernel"]), statistics.median(ms["dense"])
        rows.append(
            {
                "tokens": length,
                "kernel_ms": round(kernel, 1),
                "dense_ms": round(dense, 1),
                "speedup": round(kernel / dense, 2),
                "same_argmax": bool(last["kernel"].argmax() == last["dense"].argmax()),
                "max_logit_diff": round(float((last["kernel"] - last["dense"]).abs().max()), 3),
            }
        )
        print(rows[-1])
    route.set_rows(model, chosen)
    result = {
        "processor": processor_name(),
        "aten_cpu": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "target": args.target,
        "route_starts_at_rows": chosen,
        "rounds": args.rounds,
        "prefill": rows,
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
