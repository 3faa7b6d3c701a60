"""Read a bench JSON: per method, the median realized / predicted cost ratios (verification, draft
model; ``runs[].cost_scale``), and for each method with a "<method>-fit" twin in the same run the
geometric mean over prompts of its tokens/s over the twin's.

Run: python benchmarks/cost_ratios.py benchmarks/results/<run>.json
Last stdout line: one JSON object.
"""

import json
import math
import statistics
import sys


def main() -> None:
    with open(sys.argv[1]) as f:
        runs = json.load(f)["runs"]
    by = {(r["question_id"], r["method"]): r for r in runs}
    ids, methods = sorted({r["question_id"] for r in runs}), sorted({r["method"] for r in runs})
    result = {}
    for m in methods:
        scales = [r["cost_scale"] for r in runs if r["method"] == m and r["cost_scale"]]
        drafts = [s["draft"][0] for s in scales if s["draft"]]
        row = {"verify": round(statistics.median(s["verify"] for s in scales), 3) if scales else None,
               "draft": round(statistics.median(drafts), 3) if drafts else None}
        if m + "-fit" in methods:
            logs = [math.log(by[(i, m)]["tokens_per_s"] / by[(i, m + "-fit")]["tokens_per_s"]) for i in ids]
            row["vs_fit_twin"] = round(math.exp(statistics.fmean(logs)), 3)
        result[m] = row
        print(m, row)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
