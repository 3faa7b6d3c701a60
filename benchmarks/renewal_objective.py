"""Decide each step by the renewal-reward objective instead of the per-step ratio (issue 25, rejected).

``best_plan`` picks the plan of highest E[tokens] / time, and the draft's stop rule drafts one more column
while that ratio rises. For a sequence of steps whose offers differ, the long-run tokens per second is
maximised by the plan of highest E[tokens] − ρ·time, ρ = the long-run rate (the average-reward optimality of a
semi-Markov decision process; Dinkelbach's method), and one more column pays iff Σ P_{j+1} > ρ·Δtime. The
per-step ratio is the special case ρ = this step's own ratio. This script patches both decisions in the
library's controller for the replay and sweeps the estimate of ρ (never below the plain rate):

- ``ratio``: the shipped rule (a check: it reproduces ``hf-adaspec replay``);
- ``run:W``: the request's own rate so far (its emitted tokens over the profile's predicted step times),
  seeded with W plain steps;
- ``const:M``: M × the plain rate;
- ``pair:W``: the rate over the pair's earlier requests (discounted 0.995 per step) and this one, seeded
  with W plain steps.

Run: python benchmarks/renewal_objective.py (about 8 minutes). Last stdout line: one JSON object.
"""

import itertools
import json
import sys
from pathlib import Path

from hf_adaspec.policy import controller as ctl
from hf_adaspec.policy import goodput as gp
from hf_adaspec.tools import bench as bm
from hf_adaspec.tools.replay import Clock
from hf_adaspec.tools.replay_report import replay_all
from hf_adaspec.tools.trace import load_traces
from hf_adaspec.tools.trace_cli import _load_profile

PROFILE = Path("model_cards/qwen2.5-coder-1.5b_0.5b/profile.json")
MODES = ("ratio", "run:8", "run:32", "const:1.2", "const:1.4", "pair:4", "pair:8", "pair:16")
WORKLOADS = (("tune", "spec_bench"), ("held-out", "spec_bench"), ("all", "code"))
STATE = {"mode": "ratio", "rho": None, "pair_tokens": 0.0, "pair_ms": 0.0}


def best_plan(offers, t_verify_ms, horizon=1, min_gain=0.0, tpot_slo_ms=None):
    """``goodput.best_plan`` (no TPOT SLO) choosing by E[tokens] − ρ·time when ρ is set."""
    rows, tv1 = len(offers[0].paths), t_verify_ms(1)
    plain = gp.Plan(0, (0,) * rows, 1000.0 * rows / tv1, tv1)
    rho = STATE["rho"]
    paid = [d for d, o in enumerate(offers) if o.paid]
    free = [d for d, o in enumerate(offers) if not o.paid]
    k_top = max((len(p) for o in offers for p in o.paths), default=0)
    best, best_value, floor = plain, rows - (rho or 0.0) * tv1 / 1000.0, plain.goodput * (1 + min_gain)
    for n_paid in range(len(paid) + 1):
        for chosen in itertools.combinations(paid, n_paid):
            enabled = sorted(free + list(chosen))
            for k in range(1, k_top + 1) if enabled else ():
                tokens, picks = gp._row_picks(offers, enabled, k)
                time_ms = k * sum(offers[d].draft_ms for d in chosen) + t_verify_ms(k + 1)
                effective = time_ms + sum(offers[d].setup_ms for d in chosen) * tokens / (horizon * rows)
                rate = 1000.0 * tokens / effective
                if rate <= floor:
                    continue
                value = tokens - rho * effective / 1000.0 if rho else rate
                if (best is plain and not rho) or value > (best_value if rho else best.goodput):
                    best, best_value = gp.Plan(k, picks, rate, time_ms * rows / tokens), value
    return best


def draft_next_column(prefix_probs, next_probs, draft_ms, t_verify_ms):
    """``goodput.draft_next_column`` deciding by Σ P_{j+1} > ρ·Δtime when ρ is set."""
    j = max((len(r) for r in prefix_probs), default=0)
    tokens = sum(1.0 + sum(r[:j]) for r in prefix_probs)
    t_now, t_next = j * draft_ms + t_verify_ms(j + 1), (j + 1) * draft_ms + t_verify_ms(j + 2)
    if STATE["rho"] is None:
        return (tokens + sum(next_probs)) / t_next > tokens / t_now
    return sum(next_probs) > STATE["rho"] * (t_next - t_now) / 1000.0


_init, _decide, _observe = ctl.AdaptiveController.__init__, ctl.AdaptiveController.decide, ctl.AdaptiveController.observe


def init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.run_tokens, self.run_ms = 0.0, 0.0


def decide(self, view):
    mode, tv1 = STATE["mode"], self.costs_for(view.batch).t_verify(1)
    plain_rate = 1000.0 * view.batch / tv1
    name, _, arg = mode.partition(":")
    tokens, ms = self.run_tokens, self.run_ms
    if name == "pair":
        tokens, ms = tokens + STATE["pair_tokens"], ms + STATE["pair_ms"]
    if name == "ratio":
        rho = None
    elif name == "const":
        rho = float(arg) * plain_rate
    else:  # run, pair: the rate so far, seeded with W plain steps
        rho = 1000.0 * (tokens + float(arg) * view.batch) / (ms + float(arg) * tv1)
    STATE["rho"] = None if rho is None else max(rho, plain_rate)
    return _decide(self, view)


def observe(self, outcome):
    costs, k = self._costs, max(outcome.ks)
    paid = any(kk and self.paid[d] for d, kk in zip(outcome.drafters, outcome.ks))
    ms, tokens = k * (costs.draft_ms if paid else 0.0) + costs.t_verify(k + 1), sum(n + 1 for n in outcome.accepted)
    self.run_tokens, self.run_ms = self.run_tokens + tokens, self.run_ms + ms
    STATE["pair_tokens"] = STATE["pair_tokens"] * 0.995 + tokens
    STATE["pair_ms"] = STATE["pair_ms"] * 0.995 + ms
    _observe(self, outcome)


def main() -> None:
    ctl.best_plan, ctl.draft_next_column = best_plan, draft_next_column
    ctl.AdaptiveController.__init__, ctl.AdaptiveController.decide, ctl.AdaptiveController.observe = init, decide, observe
    clock = Clock(_load_profile(PROFILE))
    methods, out = ["plain", "adaptive", "adaptive-lookup"], {}
    for mode in (sys.argv[1].split(",") if len(sys.argv) > 1 else MODES):
        for split, workload in WORKLOADS:
            STATE.update(mode=mode, rho=None, pair_tokens=0.0, pair_ms=0.0)
            traces = [t for t in load_traces(Path("benchmarks/traces")) if split in ("all", t.split) and t.source == workload]
            result = replay_all(traces, methods, clock)
            if not all(r.matches_plain for r in result.runs):
                raise RuntimeError(f"{mode}: an output differs from its trace")
            table = bm.summarize(result.runs, methods, result.oracles)["table"]
            cells = {c: round(v["adaptive"]["speedup"], 4) for c, v in table.items()}
            out[f"{mode} {workload}:{split}"] = cells
            worst = min((c for c in cells if c != "overall"), key=cells.get)
            print(f"{mode:10s} {workload}:{split:9s} adaptive {cells['overall']:.3f}x (lowest {worst} {cells[worst]:.3f}x), "
                  f"no draft {table['overall']['adaptive-lookup']['speedup']:.3f}x", flush=True)
    print(json.dumps({k: v["overall"] for k, v in out.items()}))


if __name__ == "__main__":
    main()
