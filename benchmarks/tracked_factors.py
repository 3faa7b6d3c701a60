"""One-off (issue 37), needs 7b7e006's cost tracking: what the tracker learns under load, per quantity. Run
under `taskset -c 1 python3 -c "while True: pass" &` with HF_ADASPEC_PROFILE set: python benchmarks/tracked_factors.py"""
import json, statistics, sys
import hf_adaspec
from hf_adaspec.engine.run import SpeculationState
from hf_adaspec.tools.prompts import load_prompts
t = hf_adaspec.load("qwen2.5-coder-1.5b"); d = hf_adaspec.load("qwen2.5-coder-0.5b", quantize_lm_head=True)
hf_adaspec.enable(t.model)
from pathlib import Path
prompts = load_prompts(Path("../shared/data/spec_bench/question.jsonl"), 1, split="held-out")[:4]
state = SpeculationState()
for p in prompts:
    inputs = t.tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                             return_tensors="pt", return_dict=True)
    out = t.model.generate(**inputs, assistant_model=d.model, speculation="adaptive", cost_tracking=True,
                           max_new_tokens=128, do_sample=False, return_dict_in_generate=True, speculation_state=state)
    s = out.speculation
    plain = [x.verify_ms / x.predicted_ms for x in s.steps if x.k == 0 and x.predicted_ms > 0]
    spec = [(x.draft_ms + x.verify_ms) / x.predicted_ms for x in s.steps if x.k > 0 and x.predicted_ms > 0]
    print(json.dumps({"category": p.category, "tokens_per_s": round(s.tokens_per_s, 2), "cost_factors": {k: round(v, 2) for k, v in s.cost_factors.items()},
                      "plain_steps_realized_over_predicted": round(statistics.median(plain), 2) if plain else None,
                      "drafting_steps_realized_over_predicted": round(statistics.median(spec), 2) if spec else None}), flush=True)
trackers = {f"{k[1]}": {f"{q}@{w}": (round(dr.mean, 3), dr.count) for (q, w), dr in tr.drifts.items()} for k, tr in state.costs.trackers.items()}
print(json.dumps(trackers))
