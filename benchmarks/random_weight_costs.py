"""Do forwards of random-weight models cost what the trained models' do? (``profile --random-weights``)

Design: the trained NF4 pair (``hf_adaspec.load``) and the same architectures with random weights
(``models.architecture.load_architecture``) are timed on the same cells — target forwards over n new
tokens and the draft's 1-token forward on synthetic caches of c tokens — in interleaved rounds, with the
trained model timed twice per round so the A/A ratio (trained / trained) shows the run's noise. Per cell:
the medians and random / trained. If the ratio sits inside the A/A spread, a profile measured from the
architecture alone (on a machine that cannot hold the model files) prices the trained pair.

Run: python benchmarks/random_weight_costs.py [--repeats 7]
Last stdout line: one JSON object.
"""

import argparse
import json
import statistics

import torch

import hf_adaspec
from hf_adaspec.costs.table import time_forward_ms
from hf_adaspec.models.architecture import load_architecture
from hf_adaspec.backend import hf_compat

CELLS = [("target", c, n) for c in (128, 512) for n in (1, 4, 8)] + [("draft", c, 1) for c in (128, 512)]


def _models() -> dict[str, dict[str, torch.nn.Module]]:
    names = {"target": hf_adaspec.DEFAULT_TARGET, "draft": hf_adaspec.DEFAULT_DRAFT}
    head = {"target": False, "draft": True}
    return {"trained": {r: hf_adaspec.load(n, quantize_lm_head=head[r]).model for r, n in names.items()},
            "random": {r: load_architecture(n, quantize_lm_head=head[r]) for r, n in names.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    models = _models()
    ids = torch.randint(0, 151936, (1, 8), generator=torch.Generator().manual_seed(0))
    samples = {(kind, cell): [] for kind in ("trained", "trained-again", "random") for cell in CELLS}
    for role, context, n in CELLS:
        caches = {k: hf_compat.synthetic_cache(models[k][role], 1, context) for k in models}
        for round_ in range(args.repeats + 1):
            for kind in ("trained", "random", "trained-again"):
                model = models[kind.removesuffix("-again")][role]
                ms = time_forward_ms(model, ids[:, :n], caches[kind.removesuffix("-again")], keep=n if role == "target"
                                     else 1)
                if round_:  # round 0 warms up
                    samples[(kind, (role, context, n))].append(ms)
    rows = []
    for cell in CELLS:
        med = {kind: statistics.median(samples[(kind, cell)]) for kind in ("trained", "trained-again", "random")}
        rows.append({"role": cell[0], "context": cell[1], "new_tokens": cell[2],
                     **{f"{k}_ms": round(v, 2) for k, v in med.items()},
                     "random_over_trained": round(med["random"] / med["trained"], 3),
                     "aa_ratio": round(med["trained-again"] / med["trained"], 3)})
        print(json.dumps(rows[-1]))
    ratios = [r["random_over_trained"] for r in rows]
    aa = [r["aa_ratio"] for r in rows]
    print(json.dumps({"cells": len(rows), "random_over_trained": [min(ratios), statistics.median(ratios), max(ratios)],
                      "aa_ratio": [min(aa), statistics.median(aa), max(aa)], "repeats": args.repeats,
                      "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
