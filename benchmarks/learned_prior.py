"""Does a persisted learned state help the next process? Replay (virtual clock) of held-out Spec-Bench prompts.

For each held-out prompt, ``adaptive`` is replayed as the first request of a process twice: from a fresh
``SpeculationState`` and from the state a file holds after ``adaptive`` was replayed over the tune split (even
question ids, never the held-out prompts) and written and read back through ``engine.persist`` (counts only: the
suffix memory and the draft's caches start empty, as ``hf-adaspec generate`` starts). Both are priced by one
profile, as ratios to plain on the same clock; replay is deterministic, so an A/A control reads 1.000x exactly.

    python benchmarks/learned_prior.py --profile benchmarks/results/zen5-2026-12-02/profile.json
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from hf_adaspec.costs.profile_files import load_profile
from hf_adaspec.engine import persist
from hf_adaspec.engine.run import SpeculationState
from hf_adaspec.policy.confidence import CalibratorMemory
from hf_adaspec.policy.match import MatchMemory
from hf_adaspec.policy.modes import assistant_identity
from hf_adaspec.replay.clock import Clock
from hf_adaspec.replay.replay import VirtualDraft, replay_request
from hf_adaspec.replay.trace import load_traces

SHORT = ("qa", "translation", "extraction")


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", type=Path, default=Path("benchmarks/traces"))
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--learn-on", default="all", help="tune categories the state learns on: all | short")
    ap.add_argument("--keep", default="both", help="what the file carries: both | calibration | matches (diagnostic)")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--output", type=Path, default=None)
    args = ap.parse_args()
    traces = load_traces(args.traces)
    if args.max_new_tokens:
        traces = [t.truncated(args.max_new_tokens) for t in traces]
    clock = Clock(load_profile(args.profile))
    tune = [t for t in traces if t.split == "tune" and (args.learn_on == "all" or t.category in SHORT)]
    held = [t for t in traces if t.split == "held-out"]
    assert not {t.question_id for t in tune} & {t.question_id for t in held}  # never learned on a held-out prompt
    learned = SpeculationState()
    for t in tune:
        replay_request([t], "adaptive", learned, clock)
    pair = persist.PairKey("replayed-target", assistant_identity(VirtualDraft))
    path = Path(tempfile.mkdtemp()) / "learned.json"
    calibrators = learned.calibrators if args.keep in ("both", "calibration") else CalibratorMemory()
    matches = learned.matches if args.keep in ("both", "matches") else MatchMemory()
    persist.write_learned(path, pair, calibrators, matches)
    rows = []
    for t in held:
        loaded = SpeculationState()
        persist.read_learned(path, pair, loaded.calibrators, loaded.matches)
        plain = replay_request([t], "plain", SpeculationState(), clock)
        fresh = replay_request([t], "adaptive", SpeculationState(), clock)
        warm = replay_request([t], "adaptive", loaded, clock)
        assert fresh.matches_trace and warm.matches_trace
        rows.append(
            {
                "question_id": t.question_id,
                "category": t.category,
                "tokens": t.new_tokens,
                "fresh": plain.time_ms / fresh.time_ms,
                "learned": plain.time_ms / warm.time_ms,
                "fresh_plain_share": fresh.plain_share,
                "learned_plain_share": warm.plain_share,
            }
        )
    short = [r for r in rows if r["category"] in SHORT]
    summary = {
        group: {
            "prompts": len(rs),
            "fresh": round(_geomean([r["fresh"] for r in rs]), 4),
            "learned": round(_geomean([r["learned"] for r in rs]), 4),
            "learned_over_fresh_min": round(min(r["learned"] / r["fresh"] for r in rs), 4),
            "learned_over_fresh_max": round(max(r["learned"] / r["fresh"] for r in rs), 4),
        }
        for group, rs in (("short answers (qa, translation, extraction)", short), ("all held-out", rows))
    }
    for r in short:
        print(
            f"{r['question_id']:>6} {r['category']:<12} {r['tokens']:>4} tok  fresh {r['fresh']:.3f}x  "
            f"learned {r['learned']:.3f}x"
        )
    print(
        json.dumps(
            {
                "profile": str(args.profile),
                "learn_on": args.learn_on,
                "keep": args.keep,
                "tune_requests": len(tune),
                "calibrated_tokens": {k: c["tokens_seen"] for k, c in calibrators.counts().items()},
                "match_trials": {k: round(sum(m["trials"]), 1) for k, m in matches.counts().items()},
                "summary": summary,
            },
            indent=1,
        )
    )
    if args.output:
        args.output.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
