"""How much of the adaptive methods' loss on short answers is the horizon? Each method runs twice on
the bench's Spec-Bench prompts: with the learned horizon (``LengthMemory`` of its past requests) and with
the true one (a ``LengthMemory`` holding only this prompt's plain-greedy answer length, so the catch-up
is amortised over exactly the tokens still to come). Plain greedy runs first on each prompt (it gives
the length); the methods follow in a rotating order, each learning into its own ``SpeculationState``.
Greedy, 64 tokens, the default Qwen pair (NF4).

Run: python benchmarks/true_length_horizon.py --methods adaptive,adaptive-lookup
Last stdout line: one JSON object, per category (and "all") the geometric-mean speedup over plain of
each method and its ``-truelen`` twin.
"""

import argparse
import collections
import json
import math
import time
from pathlib import Path

from common import chat_inputs, load_pair, prompt_options

from hf_adaspec.policy.horizon import LengthMemory
from hf_adaspec.seam.integration import SpeculationState
from hf_adaspec.tools.bench import load_prompts, method_kwargs


def timed(generate, **kwargs) -> tuple[object, float]:
    """generate(**kwargs) and its wall time (s)."""
    start = time.perf_counter()
    out = generate(**kwargs)
    return out, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--methods", default="adaptive,adaptive-lookup")
    prompt_options(ap)
    args = ap.parse_args()
    model, tokenizer, draft = load_pair()
    runs = [(m, true) for m in args.methods.split(",") for true in (False, True)]
    states = {run: SpeculationState() for run in runs}
    speedups = collections.defaultdict(lambda: collections.defaultdict(list))
    for i, prompt in enumerate(load_prompts(Path(args.questions), args.per_category)):
        inputs = chat_inputs(tokenizer, prompt.text)
        out, seconds = timed(model.generate, **inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        n = out.shape[1] - inputs["input_ids"].shape[1]
        row = {"question_id": prompt.question_id, "category": prompt.category, "new_tokens": n}
        for m, true in runs[i % len(runs):] + runs[: i % len(runs)]:
            state = states[(m, true)]
            if true:
                state.lengths = LengthMemory()
                state.lengths.record(n)
            spec, s = timed(model.generate, **inputs, **method_kwargs(m, draft, 5), speculation_state=state,
                            max_new_tokens=args.max_new_tokens, do_sample=False, return_dict_in_generate=True)
            name = m + ("-truelen" if true else "")
            row[name] = round((spec.speculation.new_tokens / s) / (n / seconds), 3)
            for key in (prompt.category, "all"):
                speedups[key][name].append(row[name])
        print(json.dumps(row), flush=True)
    print(json.dumps({c: {m: round(math.exp(sum(map(math.log, v)) / len(v)), 3) for m, v in by.items()}
                      for c, by in speedups.items()}))


if __name__ == "__main__":
    main()
