"""Where each request's steps went, per method: steps by drafter, prompt-lookup tokens proposed and
accepted, and wall time against the time inside draft + verification steps (ms). Methods run on the
same Spec-Bench prompts in bench order, each learning into its own ``SpeculationState``; greedy, the
default Qwen pair (NF4), as ``hf-adaspec bench``.

Run: python benchmarks/drafter_steps.py --categories writing --methods adaptive,adaptive-lookup
Last stdout line: one JSON object (per method: lookup tokens proposed / accepted, steps by drafter).
"""

import argparse
import collections
import json
import time
from pathlib import Path

from common import MethodSession, prompt_options

from hf_adaspec.tools.bench import load_prompts


def request_row(out, wall_ms: float) -> dict:
    """One request's step breakdown from its ``SpeculationStats``."""
    s = out.speculation
    lookup = [x for x in s.steps if x.k and x.drafter == "prompt_lookup"]
    step_ms = sum(x.draft_ms + x.verify_ms for x in s.steps)
    return {"new_tokens": s.new_tokens, "wall_ms": round(wall_ms), "prefill_ms": round(s.prefill_ms),
            "outside_steps_ms": round(wall_ms - s.prefill_ms - step_ms),
            "steps": dict(collections.Counter(x.drafter if x.k else "plain" for x in s.steps)),
            "lookup_proposed": sum(x.k for x in lookup), "lookup_accepted": sum(x.accepted for x in lookup)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--categories", default="writing")
    ap.add_argument("--methods", default="adaptive,adaptive-lookup")
    prompt_options(ap)
    args = ap.parse_args()
    session = MethodSession(args.methods)
    totals = {m: collections.Counter() for m in session.methods}
    for prompt in load_prompts(Path(args.questions), args.per_category, args.categories.split(",")):
        for m in session.methods:
            start = time.perf_counter()
            out = session.generate(prompt.text, m, args.max_new_tokens)
            row = request_row(out, (time.perf_counter() - start) * 1000.0)
            totals[m].update({"lookup_proposed": row["lookup_proposed"], "lookup_accepted": row["lookup_accepted"],
                              **{f"steps_{k}": v for k, v in row["steps"].items()}})
            print(json.dumps({"question_id": prompt.question_id, "category": prompt.category, "method": m, **row}),
                  flush=True)
    print(json.dumps({m: dict(c) for m, c in totals.items()}))


if __name__ == "__main__":
    main()
