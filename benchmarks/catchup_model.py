"""What a draft forward costs in NF4 and as a dense copy, by new tokens: the measurement behind the
dense catch-up tried in 0539a22 (``assistant_catchup_model``: a dense copy of the draft ingested
pending chunks of >= 64 tokens) and reverted after its in-run A/B (README, Benchmark).

The default draft (Qwen2.5-Coder-0.5B) is loaded twice: NF4 with a quantized head, as the library's
default draft, and dense in the same compute dtype. For each chunk size n, a cache holding the 24
tokens of a chat template's system turn ingests n random tokens (one forward, median of --repeats,
the two models interleaved); "decode" is one new token after a 200-token context (median of 5).

Run: python benchmarks/catchup_model.py
Last stdout line: one JSON object (ms per chunk and per token, per model).
"""

import argparse
import json
import statistics
import time

import torch

import hf_adaspec
from hf_adaspec.backend import hf_compat

PREFIX = 24


@torch.no_grad()
def ingest_ms(model, ids: torch.Tensor, start: int, n: int) -> float:
    """Wall ms of one forward over ids[start:start + n] on a cache holding ids[:start]."""
    cache = hf_compat.new_cache(model)
    hf_compat.forward_logits(model, ids[:, :start], cache, keep=1)
    t0 = time.perf_counter()
    hf_compat.forward_logits(model, ids[:, start:start + n], cache, keep=1)
    return (time.perf_counter() - t0) * 1000.0


@torch.no_grad()
def decode_ms(model, ids: torch.Tensor, context: int) -> float:
    """Median wall ms of 5 one-token forwards after ``context`` cached tokens."""
    cache = hf_compat.new_cache(model)
    hf_compat.forward_logits(model, ids[:, :context], cache, keep=1)
    times = []
    for i in range(5):
        t0 = time.perf_counter()
        hf_compat.forward_logits(model, ids[:, context + i:context + i + 1], cache, keep=1)
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", default="16,32,64,128,160,300")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    models = {"nf4": hf_adaspec.load(hf_adaspec.DEFAULT_DRAFT, quantize_lm_head=True).model,
              "dense": hf_adaspec.load(hf_adaspec.DEFAULT_DRAFT, quantization="none").model}
    ids = torch.randint(1000, 20000, (1, PREFIX + 400), generator=torch.Generator().manual_seed(0))
    for model in models.values():  # first forwards initialise kernels
        ingest_ms(model, ids, PREFIX, 16)
    out: dict = {"chunks": {}, "decode_ms": {}}
    for n in (int(c) for c in args.chunks.split(",")):
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, model in models.items():
                times[name].append(ingest_ms(model, ids, PREFIX, n))
        cell = {name: round(statistics.median(t), 1) for name, t in times.items()}
        out["chunks"][n] = {"ms": cell, "ms_per_token": {k: round(v / n, 2) for k, v in cell.items()}}
        print(f"{n:4d} new tokens: " + ", ".join(f"{k} {v:7.1f} ms ({v / n:.2f}/token)" for k, v in cell.items()),
              flush=True)
    out["decode_ms"] = {name: round(decode_ms(model, ids, 200), 1) for name, model in models.items()}
    print("one token after 200: " + ", ".join(f"{k} {v:.1f} ms" for k, v in out["decode_ms"].items()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
