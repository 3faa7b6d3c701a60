"""Share of `adaptive`'s replayed time spent on draft tokens that verification rejected (drafting them,
and the extra verified positions), on the held-out Spec-Bench traces: how much of the gap to the oracle
rejected drafts explain. No model runs (replay on `benchmarks/traces`).

Run: python benchmarks/rejected_draft_share.py
Last stdout line: one JSON object.
"""

import json

from hf_adaspec.costs.profile import load_profile
from hf_adaspec.tools.replay import Clock, MethodState, replay_request
from hf_adaspec.tools.trace import load_traces

PROFILE = "model_cards/qwen2.5-coder-1.5b_0.5b/profile.json"


def main() -> None:
    profile = load_profile(PROFILE)
    clock, state = Clock(profile), MethodState()
    traces = [t for t in load_traces("benchmarks/traces") if t.split == "held-out" and t.source == "spec_bench"]
    total = drafting = verifying = 0.0
    for t in traces:
        run = replay_request([t], "adaptive", state, clock)
        total += run.time_ms
        context = t.prompt_len + t.new_tokens // 2
        for s in run.stats.steps:
            if s.drafter == "draft_model" and s.k > s.accepted:
                drafting += (s.k - s.accepted) * profile.draft_ms(1, context)
                verifying += profile.verify_ms(1, context, s.k + 1) - profile.verify_ms(1, context, s.accepted + 1)
    print(json.dumps({"prompts": len(traces), "drafting_share": round(drafting / total, 4),
                      "verifying_share": round(verifying / total, 4)}))


if __name__ == "__main__":
    main()
