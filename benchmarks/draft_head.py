"""Draft-model forward cost with a dense vs an NF4 output head (ms per 1-token forward, median).

Run: python benchmarks/draft_head.py [--draft qwen2.5-coder-0.5b] [--repeats 20]
Last stdout line: one JSON object.
"""

import argparse
import json
import statistics
import time

import torch

import hf_adaspec
from hf_adaspec.backend import hf_compat


def one_token_ms(model, context: int, repeats: int) -> float:
    """Median ms of a 1-token forward on a ``context``-token cache (interleaving is the caller's)."""
    ids = torch.randint(0, 1000, (1, context + 1), generator=torch.Generator().manual_seed(0))
    cache = hf_compat.new_cache(model)
    hf_compat.forward_logits(model, ids[:, :context], cache, keep=1)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        hf_compat.forward_logits(model, ids[:, context:], cache, keep=1)
        times.append((time.perf_counter() - start) * 1000.0)
        hf_compat.rollback(cache, context)
    return statistics.median(times[1:])


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draft", default=hf_adaspec.DEFAULT_DRAFT)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    models = {
        "dense_head": hf_adaspec.load(args.draft).model,
        "nf4_head": hf_adaspec.load(args.draft, quantize_lm_head=True).model,
    }
    samples: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(3):  # rounds interleave the two variants
        for name, model in models.items():
            samples[name].append(one_token_ms(model, args.context, args.repeats))
    result = {name: round(statistics.median(v), 2) for name, v in samples.items()}
    print(json.dumps({"draft": args.draft, "context": args.context, "ms_per_token": result}))


if __name__ == "__main__":
    main()
