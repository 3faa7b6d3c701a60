"""Does a replayed policy depend on the order of requests? (issue 25)

What a pair learns carries across requests (the draft's confidence calibration, the match-length tables,
suffix drafting's memory), so one unlucky first request can shape every later decision: in the file's order
the tune half's ``adaptive`` drafts with the draft model in 2 of 52 requests and never again. This replays
the chosen split in its file order and in shuffled orders (seeds 1..N) and reports, per order, the overall
speedup (geomean of per-prompt speedups), % of the hybrid oracle, the weakest category and in how many
requests the draft model drafted.

Run: python benchmarks/replay_orders.py --split tune [--orders 6] (about 20 s per order)
Last stdout line: one JSON object.
"""

import argparse
import json
import random
import statistics
from pathlib import Path

from hf_adaspec.costs.profile import load_profile
from hf_adaspec.tools import bench as bm
from hf_adaspec.tools.replay import Clock
from hf_adaspec.tools.replay_report import replay_all
from hf_adaspec.tools.trace import load_traces

METHODS = ["plain", "adaptive", "adaptive-lookup"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", default="tune", choices=("tune", "held-out", "all"))
    parser.add_argument("--workload", default="spec_bench")
    parser.add_argument("--orders", type=int, default=6, help="the file's order plus this many − 1 shuffles")
    parser.add_argument("--profile", type=Path, default=Path("model_cards/qwen2.5-coder-1.5b_0.5b/profile.json"))
    args = parser.parse_args()
    clock = Clock(load_profile(args.profile))
    chosen = [t for t in load_traces(Path("benchmarks/traces"))
              if args.split in ("all", t.split) and t.source == args.workload]
    rows = []
    for seed in range(args.orders):
        traces = list(chosen)
        if seed:
            random.Random(seed).shuffle(traces)
        result = replay_all(traces, METHODS, clock)
        table = bm.summarize(result.runs, METHODS, result.oracles)["table"]
        row = {"order": "file" if not seed else f"shuffle {seed}"}
        for m in METHODS[1:]:
            cats = {c: v[m]["speedup"] for c, v in table.items() if c != "overall"}
            weakest = min(cats, key=cats.get)
            row[m] = {"speedup": round(table["overall"][m]["speedup"], 4),
                      "pct_oracle": round(table["overall"][m]["pct_oracle"], 1),
                      "weakest": [weakest, round(cats[weakest], 3)],
                      "draft_requests": sum(1 for r in result.replays if r.method == m and r.drafter_histogram.get("draft_model"))}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(json.dumps({"split": args.split, "workload": args.workload, "orders": args.orders,
                      **{m: {"min": min(r[m]["speedup"] for r in rows), "max": max(r[m]["speedup"] for r in rows),
                             "mean": round(statistics.fmean(r[m]["speedup"] for r in rows), 4)} for m in METHODS[1:]}}))


if __name__ == "__main__":
    main()
