"""Replay adaptive (cost tracking) vs adaptive-fixed-costs: the clock priced by one profile, the controller by another.

Usage: python benchmarks/cost_tracking_replay.py load:card,quiet:quiet 3  (clock:controller pairs; 1-3 workloads).
"""
import sys
from pathlib import Path
from hf_adaspec.costs.profile import load_profile
from hf_adaspec.tools.replay import Clock
from hf_adaspec.tools.replay_report import replay_all
from hf_adaspec.tools.trace import load_traces
from hf_adaspec.tools import bench as bm
P = {k: load_profile(Path(v)) for k, v in [("card","model_cards/qwen2.5-coder-1.5b_0.5b/profile.json"),("quiet","benchmarks/results/profile_quiet.json"),("load","benchmarks/results/profile_one_core_busy.json")]}
M = ["plain", "adaptive", "adaptive-fixed-costs"]
traces = load_traces(Path("benchmarks/traces"), None)
for pair in sys.argv[1].split(","):
    clock_name, ctl_name = pair.split(":")
    for wl, split in [("spec_bench", "held-out"), ("spec_bench", "tune"), ("code", "all")][: int(sys.argv[2])]:
        chosen = [t for t in traces if t.source == wl and split in ("all", t.split)]
        r = replay_all(chosen, M, Clock(P[clock_name]), 1, None, P[ctl_name])
        o = bm.summarize(r.runs, M, r.oracles)["table"]["overall"]
        a, f = o["adaptive"]["speedup"], o["adaptive-fixed-costs"]["speedup"]
        print(f"{wl}/{split} clock={clock_name} ctl={ctl_name}: tracked {a:.4f}x fixed {f:.4f}x {100*(a/f-1):+.1f}%", flush=True)
