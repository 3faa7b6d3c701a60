"""Issue 3's per-category comparisons pooled over every committed bench run, with their run-to-run spread.

One bench run reads a category's speedup from 4 prompts, and two identical policies already differ by
up to 0.07 there (README). This script takes every results file that ran both methods of a pair
(``A/B``), computes in each run the category's geometric-mean per-prompt speedup of A over B (as
``hf-adaspec bench`` computes speedup vs plain), and reports per category the geometric mean over runs,
its standard error (over runs) and the runs it pools. Runs differ in the library's version (each
results file is named in benchmarks/README with the change it measured), so the pooled figure reads
the methods as they stood over those runs, not at one commit.

Run: python benchmarks/pooled.py --pairs confidence/plain,hybrid-confidence/confidence,hybrid-confidence/adaptive-lookup
Last stdout line: one JSON object (per pair and category: ratio, standard error, runs).
"""

import argparse
import glob
import json
import math
import statistics


def run_ratios(path: str, a: str, b: str) -> dict[str, float]:
    """Per category: exp(mean over the run's prompts of log(tokens/s of a / tokens/s of b)); {} unless
    the run has both methods."""
    runs = json.load(open(path))["runs"]
    rate = {(r["question_id"], r["method"]): r["tokens_per_s"] for r in runs}
    logs: dict[str, list[float]] = {}
    for r in runs:
        if r["method"] == a and (r["question_id"], b) in rate:
            logs.setdefault(r["category"], []).append(math.log(r["tokens_per_s"] / rate[(r["question_id"], b)]))
    return {cat: math.exp(statistics.fmean(v)) for cat, v in logs.items()}


def pool(ratios: list[float]) -> dict:
    """Geometric mean of per-run ratios, its standard error (delta method on the log scale) and count."""
    logs = [math.log(r) for r in ratios]
    se = statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else float("nan")
    mean = math.exp(statistics.fmean(logs))
    return {"ratio": round(mean, 3), "se": round(mean * se, 3), "runs": len(logs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default="confidence/plain,plain-again/plain,hybrid-confidence/confidence,"
                                       "hybrid-confidence/adaptive-lookup")
    ap.add_argument("--results", default="benchmarks/results/spec_bench_4pc_*.json",
                    help="glob(s) of results files, comma-separated")
    args = ap.parse_args()
    files = sorted({f for pattern in args.results.split(",") for f in glob.glob(pattern)})
    out: dict[str, dict] = {}
    for pair in args.pairs.split(","):
        a, b = pair.split("/")
        per_cat: dict[str, list[float]] = {}
        for path in files:
            for cat, ratio in run_ratios(path, a, b).items():
                per_cat.setdefault(cat, []).append(ratio)
        out[pair] = {cat: pool(v) for cat, v in sorted(per_cat.items())}
    cats = sorted({c for cells in out.values() for c in cells})
    print("category".ljust(16) + "".join(p.rjust(34) for p in out))
    for cat in cats:
        cells = [out[p].get(cat) for p in out]
        text = [f"{c['ratio']:.3f} ± {c['se']:.3f} ({c['runs']} runs)" if c else "–" for c in cells]
        print(cat.ljust(16) + "".join(t.rjust(34) for t in text))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
