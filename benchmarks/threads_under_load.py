"""Diagnostic: a decode step's cost with torch's threads at the machine's count and at 1, quiet and under
a process busy on one core (the target's and the draft's 1-token forward at context 128, interleaved,
medians). Last stdout line: one JSON object.

    python benchmarks/threads_under_load.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import hf_adaspec


def step_ms(model, ids: torch.Tensor, steps: int) -> float:
    """Median ms of a 1-token forward after a prefill of ids ([1, T])."""
    pkv = model(ids, use_cache=True).past_key_values
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        pkv = model(ids[:, :1], past_key_values=pkv, use_cache=True).past_key_values
        times.append(1000.0 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    args = parser.parse_args()
    target = hf_adaspec.load("qwen2.5-coder-1.5b").model
    draft = hf_adaspec.load("qwen2.5-coder-0.5b", quantize_lm_head=True).model
    ids = torch.randint(100, 1000, (1, 128), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    cells: dict[str, list[float]] = {}
    with torch.no_grad():
        for load in ("quiet", "one core busy"):
            busy = None
            if load != "quiet":
                busy = subprocess.Popen(["taskset", "-c", str(os.cpu_count() - 1), sys.executable, "-c",
                                         "while True: pass"])
                time.sleep(1.0)
            try:
                for _ in range(args.rounds):
                    for n in (threads, 1):
                        torch.set_num_threads(n)
                        for name, model in (("target", target), ("draft", draft)):
                            cells.setdefault(f"{load}, {n} threads, {name}", []).append(step_ms(model, ids, args.steps))
            finally:
                if busy is not None:
                    busy.kill()
    result = {key: round(statistics.median(v), 1) for key, v in cells.items()}
    for key, ms in result.items():
        print(f"{key}: {ms} ms")
    print(json.dumps({"threads": threads, "step_ms": result}))


if __name__ == "__main__":
    main()
