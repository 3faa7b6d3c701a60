"""Does resting pay where decisions cost? ``adaptive`` with its rest schedule vs deciding every step, by replay.

Replays the committed traces (the trained 1.5B/0.5B pair's greedy outputs) on cost profiles with the engine's
per-step overheads: ``--step-overhead-ms`` a decided step, ``--plain-overhead-ms`` a plain one (the H200's
GPU check measured 1.397 and 0.85, before the engine's later cuts), so the controller hears a decision cost
their difference. Each profile, split and workload is replayed twice: with ``policy.rest``'s schedule as
committed (``--share``, ``--after``, ``--most`` to try others) and with ``most=0`` (never rests, every step
decided). Figures are predictions (virtual clock), speedups over plain on the same clock. Tune on
``--split tune --workload spec_bench``; report on held-out Spec-Bench and the code workload.

    G=model_cards/gpu/h200-2026-11-27
    python benchmarks/rest_replay.py --profiles $G/qwen2.5-coder-1.5b_0.5b-nf4/profile.json,$G/qwen2.5-7b_coder-0.5b-bf16/profile.json

Last stdout line: one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import hf_adaspec.policy.controller as controller
from hf_adaspec.bench import bench
from hf_adaspec.costs.profile import load_profile
from hf_adaspec.policy.rest import REST_AFTER, REST_MOST, REST_SHARE, RestSchedule
from hf_adaspec.replay.replay import Clock
from hf_adaspec.replay.report import replay_all
from hf_adaspec.replay.trace import load_traces

ROOT = Path(__file__).resolve().parents[1]
SETS = (("tune", "spec_bench"), ("held-out", "spec_bench"), ("all", "code"))
METHODS = ["plain", "adaptive", "adaptive-lookup"]


def replayed(traces: list, clock: Clock, schedule: functools.partial) -> dict:
    """Speedups over plain and the share of rested steps, with ``schedule`` as every controller's rest."""
    controller.RestSchedule = schedule
    result = replay_all(traces, METHODS, clock)
    overall = bench.summarize(result.runs, METHODS, result.oracles)["table"]["overall"]
    steps = [s for r in result.replays if r.method != "plain" for s in r.stats.steps]
    return {"adaptive": round(overall["adaptive"]["speedup"], 4),
            "adaptive-lookup": round(overall["adaptive-lookup"]["speedup"], 4),
            "rested_share": round(sum(not s.decided for s in steps) / len(steps), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profiles", required=True, help="comma-separated cost profile JSON files")
    parser.add_argument("--step-overhead-ms", type=float, default=1.397)
    parser.add_argument("--plain-overhead-ms", type=float, default=0.85)
    parser.add_argument("--share", type=float, default=REST_SHARE)
    parser.add_argument("--after", type=int, default=REST_AFTER)
    parser.add_argument("--most", type=int, default=REST_MOST)
    args = parser.parse_args()
    loaded = load_traces(ROOT / "benchmarks" / "traces", None)
    rest = functools.partial(RestSchedule, share=args.share, after=args.after, most=args.most)
    never = functools.partial(RestSchedule, most=0)
    rows = []
    for path in args.profiles.split(","):
        clock = Clock(load_profile(Path(path)), args.step_overhead_ms, args.plain_overhead_ms, prefill="profile")
        for split, workload in SETS:
            traces = [t for t in loaded if split in ("all", t.split) and t.source == workload]
            row = {"profile": Path(path).parent.name, "split": split, "workload": workload, "prompts": len(traces),
                   "rest": replayed(traces, clock, rest), "every step": replayed(traces, clock, never)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(json.dumps({"kind": "replay prediction (virtual clock, not measured)", "overheads_ms":
                      [args.step_overhead_ms, args.plain_overhead_ms], "share": args.share, "after": args.after,
                      "most": args.most, "rows": rows}))


if __name__ == "__main__":
    main()
