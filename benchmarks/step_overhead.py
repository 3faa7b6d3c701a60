"""Realized engine step time vs the cost profile's prediction (k·t_draft + t_verify(k+1)).

Runs the bench's "pmin" and "adaptive" methods (64 greedy tokens) on the first Spec-Bench prompt of four categories with
the Qwen pair and compares each step's measured draft + verify time with what the controller's cost
table (the cached profile at the prompt's length) predicts for that step. A ratio above 1 is per-step
work the profile does not time (logits processing, verification, cache rollback, Python), or a
forward the profile under-predicts (the draft's fitted line at contexts below 128).

Run: python benchmarks/step_overhead.py
Last stdout line: one JSON object.
"""

import functools
import json
import statistics
import sys
from pathlib import Path

from hf_adaspec.costs.cache import CostCache
from hf_adaspec.tools.bench import load_prompts, method_kwargs
from hf_adaspec.tools.cli import SPEC_BENCH, _load_pair

CATEGORIES = ("coding", "qa", "math", "extraction")


def main() -> None:
    tgt, drf = _load_pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "nf4", "bfloat16")
    prompts = [p for p in load_prompts(Path(SPEC_BENCH), 1) if p.category in CATEGORIES]
    log = functools.partial(print, file=sys.stderr)
    ratios: dict[str, list[float]] = {}
    draft_per_token = []
    for p in prompts:
        ids = tgt.tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)
        costs = CostCache().load_or_measure(tgt.model, drf.model, 9, log, context=ids["input_ids"].shape[1])
        for mode in ("pmin", "adaptive"):
            out = tgt.model.generate(**ids, **method_kwargs(mode, drf.model, 5), max_new_tokens=64,
                                     do_sample=False, return_dict_in_generate=True)
            for s in out.speculation.steps:
                predicted = s.k * costs.draft_ms + costs.t_verify(s.k + 1)
                key = f"{mode} k={'0' if s.k == 0 else '1+'}"
                ratios.setdefault(key, []).append((s.draft_ms + s.verify_ms) / predicted)
                if s.k:
                    draft_per_token.append(s.draft_ms / s.k)
    summary = {key: {"steps": len(r), "median_realized_over_predicted": round(statistics.median(r), 3)}
               for key, r in sorted(ratios.items())}
    for key, row in summary.items():
        ratio = row["median_realized_over_predicted"]
        print(f"{key}: {row['steps']} steps, realized / predicted step time (median) {ratio}")
    print(json.dumps({"ratios": summary, "median_draft_ms_per_token": round(statistics.median(draft_per_token), 1)}))


if __name__ == "__main__":
    main()
