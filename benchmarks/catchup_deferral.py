"""When should a draft model pay its one-off prompt catch-up, if a request's answer length is unknown?

A catch-up of S ms, once paid, saves s ms on every later token (a draft step's time per token against
the alternative's). Paid at once, a request of L tokens gains s·L − S; deferred until G tokens have
been generated (and paid then only if the request is still running), it gains s·(L − G) − S when L > G,
and nothing otherwise. This script averages both over the answer lengths of a bench run's prompts
(plain greedy's, from its oracles), as a horizon learned from past requests would see that mix; it loads
no model. Defaults: a 0.7 s catch-up (a ~200-token extraction prompt, README) and 20 ms saved per token.

Run: python benchmarks/catchup_deferral.py --results benchmarks/results/spec_bench_2pc_256tok.json
Last stdout line: one JSON object (expected gain in s per request, per deferral G).
"""

import argparse
import json
import statistics


def expected_gain_s(lengths: list[int], catchup_s: float, saving_s: float, defer: int) -> float:
    """Mean over requests of the time saved (s) by paying the catch-up after ``defer`` tokens."""
    return statistics.fmean(saving_s * (n - defer) - catchup_s if n > defer else 0.0 for n in lengths)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default="benchmarks/results/spec_bench_2pc_256tok.json")
    ap.add_argument("--catchup-ms", type=float, default=700.0)
    ap.add_argument("--saving-ms", type=float, default=20.0)
    ap.add_argument("--defer", default="0,4,8,16,32")
    args = ap.parse_args()
    lengths = [o["new_tokens"] for o in json.load(open(args.results))["oracles"]]
    print(f"{len(lengths)} answers, mean {statistics.fmean(lengths):.1f} tokens, "
          f"{sum(n >= max(lengths) for n in lengths)} at the budget of {max(lengths)}")
    out = {}
    for g in (int(x) for x in args.defer.split(",")):
        out[g] = round(expected_gain_s(lengths, args.catchup_ms / 1000.0, args.saving_ms / 1000.0, g), 3)
        print(f"catch up after {g:2d} tokens: expected gain {out[g]:+.3f} s per request")
    print(json.dumps({"lengths": len(lengths), "catchup_ms": args.catchup_ms, "saving_ms": args.saving_ms,
                      "expected_gain_s": out}))


if __name__ == "__main__":
    main()
