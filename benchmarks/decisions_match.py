"""Does `speculation="adaptive"` make the same step decisions as `hybrid-confidence` did before the
consolidation (issue 24)? Runs both on the same tiny random Llama pair (fp32, shape-stable), the same
cost tables and a shared learned state over 12 requests, and compares every step's (k, accepted,
drafter). Three cost regimes: draft cheap (the draft model wins most steps), dear (prompt lookup and
plain steps win) and in between.

    git worktree add /tmp/c3056f9 c3056f9
    python benchmarks/decisions_match.py --old /tmp/c3056f9

The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys

REGIMES = {"cheap draft": (2.0, 0.3), "dear draft": (5.0, 1.0), "in between": (3.5, 2.0)}


def decisions(mode: str, draft_ms: float, catchup_ms: float) -> list[list[tuple[int, int, str]]]:
    """Every request's steps as (k, accepted, drafter), with whatever hf_adaspec is on the path."""
    import torch
    import transformers

    import hf_adaspec

    def tiny(seed: int):
        torch.manual_seed(seed)
        config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                          initializer_range=0.5, eos_token_id=None, bos_token_id=None, pad_token_id=0)
        model = transformers.LlamaForCausalLM(config).float().eval()
        model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
        return model

    torch.set_num_threads(1)
    target = hf_adaspec.enable(tiny(0))
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    costs = hf_adaspec.CostTable(verify_ms=tuple(10.0 + 1.5 * i for i in range(9)), draft_ms=draft_ms,
                                 draft_catchup_ms=catchup_ms)
    state, prompts, out = hf_adaspec.SpeculationState(), torch.Generator().manual_seed(0), []
    for r in range(12):
        ids = torch.randint(1, 64, (1, 12), generator=prompts)
        ids = torch.cat([ids, ids], dim=1) if r % 3 == 0 else ids  # some prompts repeat themselves
        res = target.generate(input_ids=ids, max_new_tokens=48, do_sample=False, speculation=mode,
                              assistant_model=draft, speculation_costs=costs, speculation_state=state,
                              return_dict_in_generate=True)
        out.append([(s.k, s.accepted, s.drafter) for s in res.speculation.steps])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="a checkout of the pre-consolidation library (e.g. c3056f9)")
    parser.add_argument("--worker", nargs=3, metavar=("MODE", "DRAFT_MS", "CATCHUP_MS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(decisions(args.worker[0], float(args.worker[1]), float(args.worker[2]))))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    report = {}
    for name, (draft_ms, catchup_ms) in REGIMES.items():
        runs = {}
        for label, path, mode in (("old", args.old, "hybrid-confidence"), ("new", here, "adaptive")):
            cmd = [sys.executable, __file__, "--old", args.old, "--worker", mode, str(draft_ms), str(catchup_ms)]
            done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path}, cwd="/", capture_output=True, text=True,
                                  check=True)
            runs[label] = json.loads(done.stdout.strip().splitlines()[-1])
        steps = [s for r in runs["new"] for s in r]
        report[name] = {"requests": len(runs["new"]), "steps": len(steps),
                        "identical_requests": sum(a == b for a, b in zip(runs["old"], runs["new"], strict=True)),
                        "drafters": {d: sum(1 for s in steps if s[2] == d) for d in ("plain", "prompt_lookup",
                                                                                     "draft_model")}}
        print(f"{name}: {report[name]}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
