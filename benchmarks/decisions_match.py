"""Does the library make the same decisions as at another commit? A check for refactors: run it against
the commit before a change that should not move any decision.

Two comparisons, each run once with this checkout and once with a worktree of ``--base`` on the path:

- ``generate`` on a tiny random Llama pair (fp32, shape-stable, one thread) with ``speculation="adaptive"``
  and a shared learned state over 12 requests, in three cost regimes: draft cheap (the draft model wins
  most steps), dear (prompt lookup, suffix drafting and plain steps win) and in between; every step's
  (k, accepted, drafter) must be equal. Batch size 1, then batches of 3 left-padded rows.
- ``hf-adaspec replay`` of the committed traces (held-out Spec-Bench and code, every replay method, batch
  sizes 1 and 4) on the model card's profile; every replayed request's summary (predicted time, steps,
  k and drafter histograms, accepted length) must be equal.

It also times the engine's own work per step (the tiny pair's forwards cost little, so the loop's Python
dominates): ms per step of a 300-token adaptive request, median of 5, the two checkouts interleaved 3 times.
Timings are reported, not judged (``--no-timing`` skips them).

``--max-slowdown X`` runs this checkout's ``adaptive`` with ``max_slowdown=X`` (the slowdown ledger's ε, issue 68;
``inf``: no bound), in ``generate`` and in the replay: with ``inf`` every decision must equal a base's from before
the ledger; with the default, the requests that differ are those where the bound binds.

    python benchmarks/decisions_match.py --base 4242903
    python benchmarks/decisions_match.py --base 7736f8b --max-slowdown inf --no-timing

The last stdout line is one JSON object; the exit code is 1 when anything differs.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REGIMES = {"cheap draft": (2.0, 0.3), "dear draft": (5.0, 1.0), "in between": (3.0, 0.5)}
PROFILE = ROOT / "model_cards" / "qwen2.5-coder-1.5b_0.5b" / "profile.json"
REPLAYS = [(workload, split, batch) for workload, split in (("spec_bench", "held-out"), ("code", "all"))
           for batch in (1, 4)]


def _tiny_pair():
    """The target (enabled) and a perturbed copy as the draft: tiny random fp32 Llamas, one thread."""
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
    return target, draft


def decisions(draft_ms: float, catchup_ms: float, batch: int) -> list[list[tuple[int, int, str, int]]]:
    """Every request's steps as (k, accepted, drafter, row), with whatever hf_adaspec is on the path (rest=False
    where it has that keyword: decisions from the costs alone, not from the engine's timing)."""
    import dataclasses

    import torch

    import hf_adaspec

    target, draft = _tiny_pair()
    costs = hf_adaspec.CostTable(verify_ms=tuple(10.0 + 1.5 * i for i in range(9)), draft_ms=draft_ms,
                                 draft_catchup_ms=catchup_ms)
    state, prompts, out = hf_adaspec.SpeculationState(), torch.Generator().manual_seed(0), []
    fields = {f.name for f in dataclasses.fields(hf_adaspec.SpeculationConfig)}
    pinned = {"rest": False} if "rest" in fields else {}
    if "max_slowdown" in fields and os.environ.get("DECISIONS_MAX_SLOWDOWN"):
        pinned["max_slowdown"] = float(os.environ["DECISIONS_MAX_SLOWDOWN"])
    for r in range(12):
        rows = []
        for b in range(batch):
            ids = torch.randint(1, 64, (12 - 2 * b,), generator=prompts)
            rows.append(torch.cat([ids, ids]) if (r + b) % 3 == 0 else ids)  # some prompts repeat themselves
        width = max(len(x) for x in rows)
        input_ids = torch.zeros(batch, width, dtype=torch.long)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for i, x in enumerate(rows):
            input_ids[i, width - len(x):], mask[i, width - len(x):] = x, 1
        res = target.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=48, do_sample=False,
                              speculation="adaptive", assistant_model=draft, speculation_costs=costs,
                              speculation_state=state, return_dict_in_generate=True, **pinned)
        out.append([(s.k, s.accepted, s.drafter, s.row) for s in res.speculation.steps])
    return out


def step_ms() -> float:
    """Median wall ms per step of a 300-token adaptive request on the tiny pair (5 requests, fresh state each)."""
    import statistics
    import time

    import torch

    import hf_adaspec

    target, draft = _tiny_pair()
    costs = hf_adaspec.CostTable(verify_ms=tuple(10.0 + 1.5 * i for i in range(9)), draft_ms=2.0, draft_catchup_ms=0.3)
    ids = torch.randint(1, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        out = target.generate(input_ids=ids, max_new_tokens=300, do_sample=False, speculation="adaptive",
                              assistant_model=draft, speculation_costs=costs,
                              speculation_state=hf_adaspec.SpeculationState(), return_dict_in_generate=True)
        times.append((time.perf_counter() - start) * 1000.0 / len({s.step for s in out.speculation.steps}))
    return statistics.median(times)


def replay(workload: str, split: str, batch: int) -> list[dict]:
    """Every replayed request's summary from ``hf-adaspec replay``, with whatever hf_adaspec is on the path."""
    try:
        from hf_adaspec.cli.cli import app
    except ImportError:  # a base from before the CLI's own folder (issue 58)
        from hf_adaspec.tools.cli import app
    if os.environ.get("DECISIONS_MAX_SLOWDOWN"):  # this checkout only: adaptive with the given ε
        import hf_adaspec.replay.replay as replayed

        given, eps = replayed.method_kwargs, float(os.environ["DECISIONS_MAX_SLOWDOWN"])
        replayed.method_kwargs = lambda m, d, k: {**given(m, d, k), **({"max_slowdown": eps} if m.startswith(
            "adaptive") else {})}

    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "replay.json"
        args = ["replay", "--traces", str(ROOT / "benchmarks" / "traces"), "--profile", str(PROFILE),
                "--split", split, "--workload", workload, "--batch-size", str(batch), "--output", str(output),
                "--methods", "plain,fixed-k,pmin,adaptive,adaptive-lookup"]
        try:
            app(args, standalone_mode=False)
        finally:
            sys.stdout.flush()
        return json.loads(output.read_text())["replays"]


def _worker(path: Path, kind: str, *args: str, slowdown: str | None = None) -> object:
    """Run ``kind`` (decisions or replay) in a child process with ``path`` first on the import path (and
    ``slowdown`` as adaptive's ``max_slowdown``, this checkout only)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, *args]
    env = {k: v for k, v in os.environ.items() if k != "DECISIONS_MAX_SLOWDOWN"}
    env |= {"PYTHONPATH": str(path), **({"DECISIONS_MAX_SLOWDOWN": slowdown} if slowdown else {})}
    done = subprocess.run(cmd, env=env, cwd="/", capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"worker {kind} {args} with {path} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _compare(base: Path, slowdown: str | None, timing: bool) -> dict:
    report: dict = {}
    for name, (draft_ms, catchup_ms) in REGIMES.items():
        for batch in (1, 3):
            old = _worker(base, "decisions", str(draft_ms), str(catchup_ms), str(batch))
            new = _worker(ROOT, "decisions", str(draft_ms), str(catchup_ms), str(batch), slowdown=slowdown)
            steps = [s for r in new for s in r]
            report[f"generate, {name}, B={batch}"] = {
                "requests": len(new), "steps": len(steps),
                "identical_requests": sum(a == b for a, b in zip(old, new, strict=True)),
                "drafters": {d: sum(1 for s in steps if s[2] == d) for d in ("plain", "prompt_lookup", "suffix",
                                                                             "draft_model")}}
            print(f"generate, {name}, B={batch}: {report[f'generate, {name}, B={batch}']}", flush=True)
    timed = {"base": [], "this": []}
    for _ in range(3 if timing else 0):
        for label, path in (("base", base), ("this", ROOT)):
            timed[label].append(round(_worker(path, "step_ms"), 3))
    report["engine ms per step (tiny pair), not judged"] = timed
    print(f"engine ms per step: {timed}", flush=True)
    for workload, split, batch in REPLAYS:
        old = _worker(base, "replay", workload, split, str(batch))
        new = _worker(ROOT, "replay", workload, split, str(batch), slowdown=slowdown)
        key = f"replay {workload} {split}, B={batch}"
        report[key] = {"requests": len(new), "identical_requests": sum(a == b for a, b in zip(old, new, strict=True)),
                       "steps": sum(r["steps"] for r in new)}
        print(f"{key}: {report[key]}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="the commit to compare with (a worktree of it is made and removed)")
    parser.add_argument("--max-slowdown", help="this checkout's adaptive max_slowdown (e.g. inf)")
    parser.add_argument("--no-timing", action="store_true", help="skip the engine's ms per step")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, rest = args.worker[0], args.worker[1:]
        if kind == "decisions":
            result = decisions(float(rest[0]), float(rest[1]), int(rest[2]))
        else:
            result = step_ms() if kind == "step_ms" else replay(rest[0], rest[1], int(rest[2]))
        print(json.dumps(result))
        return
    if not args.base:
        parser.error("--base COMMIT is required")
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), args.base], check=True)
        try:
            report = _compare(tree, args.max_slowdown, not args.no_timing)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=True)
    same = all(r["identical_requests"] == r["requests"] for r in report.values() if "requests" in r)
    print(json.dumps({"base": args.base, "max_slowdown": args.max_slowdown, "identical": same, "comparisons": report}))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
