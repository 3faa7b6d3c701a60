"""The engine's own time per token where forwards cost almost nothing: a GPU's case, reproduced on a CPU.

On a GPU with recorded graphs a decoding step of the 1.5B costs ~5 ms, so the Python around it (offers, the
controller, verification, commit) decides whether ``adaptive`` keeps up with a plain loop when it ends up
making plain steps (the GPU check's never-loses bar). This runs the GPU check's tiny random-weight pair
(``gpu_check --tiny``: the presets' Qwen2 architecture, 2 layers, 64 wide, a 256-token vocabulary) on one
thread: the forwards are ~1 ms and touch little memory, so the CPU's caches stay warm around them as a GPU
host's do (a forward streaming tens of MB would make every later Python step slower, as a GPU never does).

Methods, interleaved per prompt (order alternating), each request from a fresh ``SpeculationState``:
``hf`` (transformers' generate), ``plain`` (``fixed`` k = 0: the engine's loop with plain steps) and
``plain-again`` (the A/A), ``adaptive`` (with the random-weight draft: acceptance ≈ 0, so it makes plain
steps) and ``adaptive-lookup`` (no draft model). ``--base <commit>``: the same worker run in a worktree of
that commit too, the two alternating, so the figures compare commits. Last line: one JSON object (ms per
token: the median over rounds of each prompt's ms, averaged over prompts).

    python benchmarks/engine_overhead.py --base 77d406d --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("hf", "plain", "plain-again", "adaptive", "adaptive-lookup")
WORKER = r"""
import json, sys, tempfile, time
from pathlib import Path
import torch
import hf_adaspec
from hf_adaspec.gpu_check import steps as cs
torch.set_num_threads(1)
job = json.loads(sys.argv[1])
check = cs.Check("cpu", True, Path(tempfile.mkdtemp()), kv_cache="dynamic")
target, draft = check.model(cs.TARGET, "none"), check.model(cs.DRAFT, "none", head=True)
plain = check.spec(speculation="fixed", num_speculative_tokens=0)
kwargs = {"hf": {}, "plain": plain, "plain-again": plain,
          "adaptive": check.spec(speculation="adaptive", assistant_model=draft),
          "adaptive-lookup": check.spec(speculation="adaptive")}
gen = torch.Generator().manual_seed(job["seed"])
prompts = [torch.randint(3, target.config.vocab_size, (24,), generator=gen).tolist() for _ in range(job["prompts"])]
for m in kwargs:  # costs calibrated or found, first calls paid, before timing
    cs.generate(target, prompts[0], 8, kwargs[m])
ms = {m: [] for m in kwargs}
for i, prompt in enumerate(prompts):
    for m in (list(kwargs) if i % 2 == 0 else list(reversed(kwargs))):
        start = time.perf_counter()
        out = cs.generate(target, prompt, job["new"], kwargs[m])
        ms[m].append((time.perf_counter() - start) * 1000.0 / (out.sequences.shape[1] - len(prompt)))
print(json.dumps({"file": hf_adaspec.__file__, "ms_per_token": ms}))
"""


def _round(tree: Path, job: dict) -> dict[str, list[float]]:
    """One worker process in ``tree``: ms per token of every method on every prompt."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(job)], cwd=tree, env=env, check=True,
                          capture_output=True, text=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    if not out["file"].startswith(str(tree)):
        raise RuntimeError(f"the worker for {tree} imported {out['file']}")
    return out["ms_per_token"]


def _summary(rounds: list[dict[str, list[float]]]) -> dict:
    """Per method: the mean over prompts of the median over rounds (ms per token); the gaps to ``plain``."""
    prompts = len(rounds[0]["plain"])
    ms = {m: round(statistics.fmean(statistics.median(r[m][i] for r in rounds) for i in range(prompts)), 4)
          for m in METHODS}
    return {"ms_per_token": ms, "adaptive_minus_plain_ms": round(ms["adaptive"] - ms["plain"], 4),
            "adaptive_over_plain_speed": round(ms["plain"] / ms["adaptive"], 3),
            "plain_again_over_plain_speed": round(ms["plain"] / ms["plain-again"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="a commit to compare this tree with (run in a temporary worktree)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    job = {"seed": 0, "prompts": args.prompts, "new": args.max_new_tokens}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"new": ROOT}
        if args.base:
            trees["base"] = Path(tmp) / "base"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(trees["base"]), args.base],
                           check=True, capture_output=True)
        try:
            rounds: dict[str, list] = {v: [] for v in trees}
            for r in range(args.rounds):
                for v in (list(trees) if r % 2 == 0 else list(reversed(trees))):
                    rounds[v].append(_round(trees[v], job))
                    print(f"round {r} {v}: " + json.dumps(_summary(rounds[v][-1:])["ms_per_token"]), flush=True)
        finally:
            if args.base:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees["base"])],
                               capture_output=True)
    result = {v: _summary(rs) for v, rs in rounds.items()}
    print(json.dumps({"base": args.base, "rounds": args.rounds, "prompts": args.prompts,
                      "max_new_tokens": args.max_new_tokens, **result}))


if __name__ == "__main__":
    main()
