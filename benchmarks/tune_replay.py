"""Policy variants decided by replay: each variant's predicted speedup over plain on the traces of one split.

A variant changes one constant of the policy (by patching it for the run: a tuning aid, not an option of
the library); every variant is replayed on the same traces with the same profile, so differences are
exact under the cost model (no timing noise). Tune on the "tune" split, then check the winner on
"held-out" and the code workloads with ``hf-adaspec replay``.

Run: python benchmarks/tune_replay.py --split tune [--workload spec_bench]
Last stdout line: one JSON object.
"""

import argparse
import json
import math
from contextlib import ExitStack
from unittest import mock

from hf_adaspec.costs.profile import load_profile
from hf_adaspec.tools.replay import Clock
from hf_adaspec.tools.replay_report import replay_all
from hf_adaspec.tools.trace import load_traces

PROFILE = "model_cards/qwen2.5-coder-1.5b_0.5b/profile.json"
VARIANTS = {  # name → {patched attribute: value}
    "current": {},
    "min_gain=0": {"hf_adaspec.policy.controller.MIN_GAIN": 0.0},
    "min_gain=0.06": {"hf_adaspec.policy.controller.MIN_GAIN": 0.06},
    "match decay=0.95": {"hf_adaspec.policy.match.MatchTable.__init__.__defaults__": (0.37, 2.0, 0.95)},
    "match decay=0.995": {"hf_adaspec.policy.match.MatchTable.__init__.__defaults__": (0.37, 2.0, 0.995)},
    "lookup start=0.25": {"hf_adaspec.policy.match.MatchTable.__init__.__defaults__": (0.25, 2.0, 0.98)},
    "lookup start=0.5": {"hf_adaspec.policy.match.MatchTable.__init__.__defaults__": (0.5, 2.0, 0.98)},
    "optimism=0.5": {"hf_adaspec.policy.confidence.ConfidenceCalibrator.__init__.__defaults__": (10, 2.0, 0.7, 0.5)},
    "optimism=0": {"hf_adaspec.policy.confidence.ConfidenceCalibrator.__init__.__defaults__": (10, 2.0, 0.7, 0.0)},
}


def _patch(stack: ExitStack, target: str, value) -> None:
    owner, attr = target.rsplit(".", 1)
    parts = owner.split(".")
    obj = __import__(parts[0])
    for p in parts[1:]:
        obj = getattr(obj, p)
    stack.enter_context(mock.patch.object(obj, attr, value))


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--split", default="tune")
    ap.add_argument("--workload", default="spec_bench")
    ap.add_argument("--methods", default="adaptive,adaptive-lookup")
    args = ap.parse_args()
    traces = [t for t in load_traces("benchmarks/traces")
              if args.split in ("all", t.split) and args.workload in ("all", t.source)]
    clock = Clock(load_profile(PROFILE))
    methods = args.methods.split(",")
    out = {}
    for name, patches in VARIANTS.items():
        with ExitStack() as stack:
            for target, value in patches.items():
                _patch(stack, target, value)
            result = replay_all(traces, ["plain", *methods], clock)
        plain = {r.question_id: r.tokens_per_s for r in result.runs if r.method == "plain"}
        row = {}
        for m in methods:
            runs = [r for r in result.runs if r.method == m]
            per_cat: dict[str, list[float]] = {}
            for r in runs:
                per_cat.setdefault(r.category, []).append(r.tokens_per_s / plain[r.question_id])
            cats = {c: geomean(v) for c, v in per_cat.items()}
            row[m] = {"overall": round(geomean([r.tokens_per_s / plain[r.question_id] for r in runs]), 4),
                      "worst_category": min(cats, key=cats.get), "worst": round(min(cats.values()), 4)}
        out[name] = row
        print(name.ljust(20), json.dumps(row))
    print(json.dumps({"split": args.split, "workload": args.workload, "prompts": len(traces), "variants": out}))


if __name__ == "__main__":
    main()
