"""Interleaved A/B of two commits on this machine: does a change make generation slower here?

One worker process per checkout (``--base``: a commit, checked out into a temporary worktree; the other is
this tree) loads the default pair the same way, then for each prompt every method runs in both workers, the
order alternating between prompts; a worker waits idle while the other runs, so the two never share the
cores. ``plain`` is transformers' own generate, the same code in both unless the change is in the forward itself
(the q4 kernel): its new/base ratio is then the change's effect, and the A/A control is each worker's ``plain``
timed twice (``plain-again`` over ``plain``), the noise the other ratios must exceed. Each method learns into its own state, fresh per worker; no prompt is
seen twice. Speed = geometric mean over prompts of tokens/s; last line one JSON object.

    python benchmarks/ab_commits.py --base d35ceba --prompts 4 --max-new-tokens 256
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = r"""
import json, sys, time
import torch
import hf_adaspec
target = hf_adaspec.load(hf_adaspec.DEFAULT_TARGET)
draft = hf_adaspec.load(hf_adaspec.DEFAULT_DRAFT, quantize_lm_head=True)
hf_adaspec.enable(target.model)
states = {}
warm = target.tokenizer("def f(x):", return_tensors="pt")
target.model.generate(**warm, max_new_tokens=4, do_sample=False, speculation="adaptive", assistant_model=draft.model,
                      speculation_state=hf_adaspec.SpeculationState())  # costs found or calibrated before timing
print(json.dumps({"ready": hf_adaspec.__file__}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": job["prompt"]}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
    extra = {}
    if job["method"] == "adaptive":
        state = states.setdefault("adaptive", hf_adaspec.SpeculationState())
        extra = {"speculation": "adaptive", "assistant_model": draft.model, "speculation_state": state}
    start = time.perf_counter()
    out = target.model.generate(**ids, max_new_tokens=job["new"], do_sample=False, **extra)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "tokens": int(out.shape[1] - ids["input_ids"].shape[1]),
                      "text": out[0, ids["input_ids"].shape[1]:].tolist()}), flush=True)
"""


def _worker(tree: Path) -> subprocess.Popen:
    os = __import__("os")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen([sys.executable, "-c", WORKER], cwd=tree, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    ready = json.loads(proc.stdout.readline())
    if not ready["ready"].startswith(str(tree)):
        raise RuntimeError(f"the worker for {tree} imported {ready['ready']}")
    return proc


def _ask(proc: subprocess.Popen, job: dict) -> dict:
    proc.stdin.write(json.dumps(job) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def _prompts(path: Path, count: int) -> list[str]:
    """The first turn of the first odd-id (held-out) prompt of ``count`` categories."""
    seen, out = set(), []
    for row in map(json.loads, path.read_text().splitlines()):
        if row["question_id"] % 2 == 1 and row["category"] not in seen and len(out) < count:
            seen.add(row["category"])
            out.append(row["turns"][0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare this tree with")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--questions", type=Path, default=ROOT.parent / "shared/data/spec_bench/question.jsonl")
    args = parser.parse_args()
    prompts = _prompts(args.questions, args.prompts)
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.base], check=True,
                       capture_output=True)
        try:
            workers = {"base": _worker(base), "new": _worker(ROOT)}
            methods = ("plain", "plain-again", "adaptive")
            tps = {(v, m): [] for v in workers for m in methods}
            same_text = []
            for i, prompt in enumerate(prompts):
                for k, method in enumerate(methods):
                    order = ["base", "new"] if (i + k) % 2 == 0 else ["new", "base"]
                    got = {v: _ask(workers[v], {"prompt": prompt, "method": method, "new": args.max_new_tokens})
                           for v in order}
                    for v, r in got.items():
                        tps[(v, method)].append(r["tokens"] / r["seconds"])
                    same_text.append(got["base"]["text"] == got["new"]["text"])
                    print(f"prompt {i} {method}: " + ", ".join(f"{v} {got[v]['tokens'] / got[v]['seconds']:.2f} tok/s"
                                                              for v in order), flush=True)
            for proc in workers.values():
                proc.stdin.close()
                proc.wait()
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], capture_output=True)
    geo = {f"{v} {m}": round(math.exp(statistics.fmean(math.log(x) for x in xs)), 3) for (v, m), xs in tps.items()}
    ratio = {m: round(geo[f"new {m}"] / geo[f"base {m}"], 3) for m in ("plain", "adaptive")}
    within = {v: round(geo[f"{v} plain-again"] / geo[f"{v} plain"], 3) for v in ("base", "new")}
    print(json.dumps({"base": args.base, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
                      "tokens_per_s": geo, "new_over_base": ratio, "aa_control": ratio["plain"],
                      "aa_within": within, "same_tokens": all(same_text)}))


if __name__ == "__main__":
    main()
