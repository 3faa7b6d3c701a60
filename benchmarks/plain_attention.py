"""transformers' plain ``generate`` on the default target (q4) after ``enable``: transformers' own attention
against the packed attention that speculative requests swap in, ms per decoding step at a short and a long prompt.

``enable`` leaves plain ``generate`` as transformers runs it (sdpa, its cache) on a model loaded elsewhere; only a
speculative request swaps in the packed attention (``hf_adaspec.load`` makes it a q4 model's own; here the model is
loaded by ``models.loading.load``, before that step, so it starts with transformers'). This measures what
transformers' attention costs plain decoding: per prompt and round, the time of
``generate`` for 34 tokens less that for 2 (prefill and first token cancel), over 32 steps, each attention in
turn (interleaved). Held-out Spec-Bench prompts 161 (short) and 241 (long) of the packaged subset.

Run (a few minutes on 2 cores): ``python benchmarks/plain_attention.py [--rounds 2]``. The last line is one JSON
object: ms per step per prompt and attention (medians over rounds) and the processor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from hf_adaspec import enable
from hf_adaspec.backend import hf_compat
from hf_adaspec.bench.prompts import SPEC_BENCH, load_prompts
from hf_adaspec.machine import processor_name
from hf_adaspec.models.loading import load

PROMPTS = (161, 241)


def _ms(model, inputs, n: int) -> float:
    start = time.perf_counter()
    model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return (time.perf_counter() - start) * 1000.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    tgt = load("qwen2.5-coder-1.5b")  # transformers' attention: not hf_adaspec.load's
    enable(tgt.model)
    swap = hf_compat.AttentionSwap(tgt.model)
    prompts = [p for p in load_prompts(SPEC_BENCH, 1, None, "held-out") if p.question_id in PROMPTS]
    out: dict[str, dict] = {}
    for p in prompts:
        inputs = tgt.tokenizer.apply_chat_template(
            p.messages(), add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        per = {"own": [], "packed": []}
        for _ in range(args.rounds):
            for how in per:
                with hf_compat.speculative_attention(*([swap] if how == "packed" else [])):
                    per[how].append((_ms(tgt.model, inputs, 34) - _ms(tgt.model, inputs, 2)) / 32)
        out[str(p.question_id)] = {
            "prompt_tokens": inputs["input_ids"].shape[1],
            **{how: round(statistics.median(v), 1) for how, v in per.items()},
        }
        print(p.question_id, out[str(p.question_id)], flush=True)
    print(json.dumps({"ms_per_step": out, "rounds": args.rounds, "processor": processor_name()}))


if __name__ == "__main__":
    main()
