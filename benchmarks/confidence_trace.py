"""Per-step decisions of the adaptive methods on one Spec-Bench category: each method first learns on
the bench's prompts before that category (as in ``hf-adaspec bench``, each in its own
``SpeculationState``), then every step of the category's requests is printed: drafter, k, accepted,
the predicted α (P_1 for the draft model, from its calibrated confidence) and goodput (tokens/s),
draft and verify time (ms). Greedy, the default Qwen pair (NF4).

Run: python benchmarks/confidence_trace.py --category translation --methods adaptive
Last stdout line: one JSON object (per method: draft-model tokens drafted, accepted, and the mean
predicted α of its steps on the category).
"""

import argparse
import collections
import json
from pathlib import Path

from common import MethodSession, prompt_options

from hf_adaspec.tools.bench import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--category", default="translation")
    ap.add_argument("--methods", default="adaptive")
    prompt_options(ap)
    args = ap.parse_args()
    session = MethodSession(args.methods)
    totals = {m: collections.Counter() for m in session.methods}
    prompts = load_prompts(Path(args.questions), args.per_category)
    last = max(i for i, p in enumerate(prompts) if p.category == args.category)
    for prompt in prompts[: last + 1]:
        for m in session.methods:
            out = session.generate(prompt.text, m, args.max_new_tokens)
            if prompt.category == args.category:
                print(f"{prompt.question_id} {m}: {out.speculation.new_tokens} tokens")
                for s in out.speculation.steps:
                    print(f"    {s.drafter:14s} k {s.k} accepted {s.accepted} alpha {s.alpha:.2f} "
                          f"goodput {s.predicted_goodput:.1f} draft {s.draft_ms:.0f} ms verify {s.verify_ms:.0f} ms")
                drafted = [s for s in out.speculation.steps if s.drafter == "draft_model"]
                totals[m].update({"drafted": sum(s.k for s in drafted), "accepted": sum(s.accepted for s in drafted),
                                  "steps": len(drafted), "alpha_sum": sum(s.alpha for s in drafted)})
    print(json.dumps({m: {"drafted": c["drafted"], "accepted": c["accepted"],
                          "mean_predicted_alpha": round(c["alpha_sum"] / max(1, c["steps"]), 3)}
                      for m, c in totals.items()}))


if __name__ == "__main__":
    main()
