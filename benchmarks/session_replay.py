"""Spec-Bench second turns replayed as sessions: each question's first turn, then its second turn.

Design: the second-turn traces (ids 2xxxx, ``benchmarks/workloads/make_turn2_workload.py``) hold the
first turn and the target's own answer in their prompt. Replayed alone, the draft model pays that whole
history as catch-up; in a session the draft's prefix store (``engine.draft_prefix``) starts the second
turn from the first turn's cache. This replays, per split, first turn q then second turn 20000 + q for
every traced second turn, with plain, adaptive and adaptive without the draft model (learned state
carried in order, as ``hf-adaspec replay`` does), and reports geometric-mean speedups of each turn, the
worst second turn, and the draft prefix reused. Figures are replay predictions.

Run: python benchmarks/session_replay.py
Last stdout line: one JSON object.
"""

import json
import math
from pathlib import Path

from hf_adaspec.costs.profile import load_profile
from hf_adaspec.tools.replay import Clock
from hf_adaspec.tools.replay_report import replay_all
from hf_adaspec.tools.trace import load_traces

PROFILE = "model_cards/qwen2.5-coder-1.5b_0.5b/profile.json"
OFFSET = 20000
METHODS = ("adaptive", "adaptive-lookup")


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def main() -> None:
    traces = {t.question_id: t for t in load_traces(Path("benchmarks/traces"))}
    second = sorted(q for q in traces if q >= OFFSET and q - OFFSET in traces)
    clock, out = Clock(load_profile(PROFILE)), {}
    for split in ("tune", "held-out"):
        order = [traces[x] for q in second if traces[q].split == split for x in (q - OFFSET, q)]
        result = replay_all(order, ["plain", *METHODS], clock)
        assert all(r.matches_plain for r in result.runs), "a replay left its trace"
        plain = {r.question_id: r.tokens_per_s for r in result.runs if r.method == "plain"}
        for m in METHODS:
            runs = [r for r in result.runs if r.method == m]
            turn2 = [r.tokens_per_s / plain[r.question_id] for r in runs if r.question_id >= OFFSET]
            turn1 = [r.tokens_per_s / plain[r.question_id] for r in runs if r.question_id < OFFSET]
            row = {"turn1": round(geomean(turn1), 3), "turn2": round(geomean(turn2), 3),
                   "worst_turn2": round(min(turn2), 3),
                   "draft_prefix_tokens": [r.draft_prefix_tokens for r in runs if r.question_id >= OFFSET]}
            out[f"{split}/{m}"] = row
            print(f"{split:9s} {m:16s}", json.dumps(row))
    print(json.dumps({"label": "replay prediction", "sessions": len(second), "results": out}))


if __name__ == "__main__":
    main()
