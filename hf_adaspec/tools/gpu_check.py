"""``make gpu-check``: one prepared pass over what only a GPU can tell (issue 36), proven on the CPU first.

``python -m hf_adaspec.tools.gpu_check --device cuda [--out DIR] [--budget-s 480]`` runs the steps of ``plan``
in order, each in its own try/except, and rewrites ``gpu_check.json`` (atomically) and ``gpu_check.md`` after
every step, so a run cut off by its time limit still leaves what finished; once the budget is spent the
rest is recorded as "skipped: budget". Every model has a preset's architecture (``models/configs``, the 7B's
too) and seeded random weights. ``--tiny``: shrunk configs and grids (tests/test_gpu_check.py, on the CPU).
``--steps a,b``: only those, merged into an existing results file (e.g. ``--steps replay`` on a CPU, from
the profiles a GPU run left: the replay is CPU work, skipped on a GPU).

Steps: environment (versions, the GPU; NF4 only if bitsandbytes' kernels load, else every NF4 step records
the bf16 fallback); sampling (``gpu_check_steps``: chi-square test of lossless sampling); per quantization
(bf16, NF4) greedy (speculative greedy = plain greedy), self-draft and the shipped pair's profile;
never-loses (wall clock: ``adaptive`` with the random-weight draft within 3% of plain, with the self-draft
within 3% of ``fixed`` or faster); engine (the engine's own ms per step, wall less the forwards); the
profiles of the 7B target with the 0.5B draft; replay (projections on every profile, batch 1, 2, 4, 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from ..costs.measure import ProfileGrid, measure_profile, pair_name, plot_profile
from ..costs.profile import load_profile, save_profile
from ..costs.table import processor_name
from . import gpu_check_steps as cs
from .gpu_check_report import REPLAY_METHODS, RESULTS, SUMMARY, write_results
from .gpu_check_sampling import sampling
from .gpu_check_steps import BIG, DRAFT, QUANT_LABEL, TARGET, Check

BUDGET_S = 480.0
TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"
GPU_GRID = ProfileGrid(new_tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16), batch_sizes=(1, 2, 4, 8),
                       contexts=(128, 512, 1024, 2048), repeats=2)
TINY_GRID = ProfileGrid(new_tokens=(1, 2, 3), batch_sizes=(1, 2), contexts=(16, 32), repeats=1)
WIN_MARGIN = 0.97  # "within 3%"


def environment(check: Check) -> dict:
    """Versions and the device; NF4 stays only if bitsandbytes imports and a 4-bit round trip runs here."""
    import transformers

    gpu = torch.cuda.get_device_name(0) if check.device.startswith("cuda") else None
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": check.device, "gpu": gpu, "cpu": processor_name(),
            "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if gpu else None}
    try:
        import bitsandbytes
        import bitsandbytes.functional as bnbf

        x = torch.randn(64, 64, dtype=torch.bfloat16, device=check.device)
        if not torch.allclose(bnbf.dequantize_4bit(*bnbf.quantize_4bit(x, quant_type="nf4")), x, atol=1.0):
            raise RuntimeError("the NF4 round trip is off")
        info.update(bitsandbytes=bitsandbytes.__version__, nf4=f"bitsandbytes {bitsandbytes.__version__} loads")
    except Exception as e:  # noqa: BLE001 - whatever keeps NF4 from running, the check goes on in bf16
        check.quantizations = ("none",)
        check.fallback = f"FALLBACK: bitsandbytes did not load ({type(e).__name__}: {e}); NF4 steps fall back to bf16"
        info.update(bitsandbytes=None, nf4=check.fallback)
        print(f"[gpu-check] {check.fallback}", flush=True)
    line = f"{gpu or check.device}, torch {torch.__version__}, transformers {transformers.__version__}; {info['nf4']}"
    return {**info, "passed": None, "summary": line}


def profile_pair(check: Check, target: str, quantization: str) -> dict:
    """``hf-adaspec profile --random-weights`` of (target, the 0.5B draft) in one quantization, saved as
    ``<out>/<pair>-<nf4|bf16>/profile.json`` (its command names the GPU); the costs that matter read back."""
    if quantization not in check.quantizations:
        return {"passed": None, "fallback": True, "summary": check.fallback}
    if target == BIG:
        check.drop(keep=[k for k in check.models if k[0] == DRAFT and k[1] == quantization])
    tgt, drf = check.model(target, quantization), check.model(DRAFT, quantization, head=True)
    grid, pair, csv = TINY_GRID if check.tiny else GPU_GRID, pair_name(target, DRAFT), lambda v: ",".join(map(str, v))
    command = (f"hf-adaspec profile --target {target} --draft {DRAFT} --quantization {quantization} --dtype bfloat16 "
               f"--contexts {csv(grid.contexts)} --batch-sizes {csv(grid.batch_sizes)} --new-tokens "
               f"{csv(grid.new_tokens)} --repeats {grid.repeats} --max-tokens-per-forward "
               f"{grid.max_tokens_per_forward} --device {check.device} --random-weights"
               f"  # by hf_adaspec.tools.gpu_check on {check.facts.get('gpu') or check.device}")
    profile = measure_profile(tgt, drf, grid, pair, command)
    path = save_profile(profile, check.out / f"{pair}-{QUANT_LABEL[quantization]}" / "profile.json")
    try:
        plot_profile(profile, path.with_name("cost_curves.png"))
    except ImportError:
        pass
    c = 32 if check.tiny else 512
    costs = {f"b{b}": {"verify_ms_n1": round(profile.verify_ms(b, c, 1), 2), "verify_ms_n5": round(
        profile.verify_ms(b, c, 5), 2), "draft_ms": round(profile.draft_ms(b, c), 2)} for b in grid.batch_sizes}
    ratio, b1 = profile.draft_ms(1, c) / profile.verify_ms(1, c, 1), costs["b1"]
    heads = (tgt.get_output_embeddings().out_features, drf.get_output_embeddings().out_features)
    vocab = "" if heads[0] == heads[1] else f"; output heads {heads[0]} vs {heads[1]}: " + _pair_refused(tgt, drf)
    return {"passed": None, "path": str(path), "context": c, "costs": costs, "draft_over_target_b1": round(ratio, 3),
            "heads": heads, "summary": f"{path.parent.name}: at batch 1 and context {c} the target's forward over 1 "
                                       f"token {b1['verify_ms_n1']} ms, over 5 {b1['verify_ms_n5']} ms, the draft's "
                                       f"token {b1['draft_ms']} ms ({ratio:.2f} of the target's){vocab}"}


def _pair_refused(target, draft) -> str:
    """Whether ``generate`` takes (target, draft) as a pair, asked with one token."""
    try:
        cs.generate(target, [1, 2, 3], 1, {"speculation": "adaptive", "assistant_model": draft})
    except ValueError as e:
        return f"generate refuses the pair ({e}); the profile does not depend on it"
    return "generate takes the pair"


def _pair(check: Check):
    """The shipped pair in NF4 (bf16 without bitsandbytes), its quantization, and its profile's path if measured."""
    q = "nf4" if "nf4" in check.quantizations else "none"
    path = check.out / f"{pair_name(TARGET, DRAFT)}-{QUANT_LABEL[q]}" / "profile.json"
    return check.model(TARGET, q), check.model(DRAFT, q, head=True), q, path if path.is_file() else None


def never_loses(check: Check) -> dict:
    """Wall clock: ``adaptive`` with the random-weight draft (acceptance ≈ 0) at ≥ 97% of plain's tokens/s,
    with the self-draft (acceptance ≈ 1) at ≥ 97% of ``fixed``'s (k = 4). Judged on a GPU, not with --tiny."""
    tgt, drf, q, profile = _pair(check)
    given = {"speculation_profile": str(profile)} if profile else {}
    methods = {"plain": {}, "adaptive": {"speculation": "adaptive", "assistant_model": drf, **given},
               "fixed-self": {"speculation": "fixed", "num_speculative_tokens": 4, "assistant_model": tgt},
               "adaptive-self": {"speculation": "adaptive", "assistant_model": tgt}}
    prompts = cs.check_prompts(tgt.config.vocab_size, seed=5)[::2]
    tps = cs.timed_runs(tgt, methods, prompts, 12 if check.tiny else 64, 1 if check.tiny else 2)
    vs_plain, vs_fixed = tps["adaptive"] / tps["plain"], tps["adaptive-self"] / tps["fixed-self"]
    random_ok, self_ok = vs_plain >= WIN_MARGIN, vs_fixed >= WIN_MARGIN
    line = (f"{QUANT_LABEL[q]}: adaptive/plain {vs_plain:.3f} (random draft), adaptive/fixed {vs_fixed:.3f} (self-draft)"
            + ("; not judged (--tiny)" if check.tiny else ""))
    return {"passed": None if check.tiny else random_ok and self_ok, "tokens_per_s": tps, "quantization": q,
            "cost_source": "profile" if given else "calibrated", "random_draft_ok": random_ok, "self_draft_ok": self_ok,
            "summary": line}


def engine_time(check: Check) -> dict:
    """The engine's own ms per step at batch 1 (wall less every forward, forwards timed with the device
    synchronised) against the target's mean forward, and transformers' own ms per token for plain; the median
    over the speculative runs and plain's become the replay's overheads."""
    tgt, drf, q, _ = _pair(check)
    prompt, new = cs.check_prompts(tgt.config.vocab_size, seed=6)[0], 12 if check.tiny else 128
    runs = {"adaptive": {"speculation": "adaptive", "assistant_model": drf},
            "adaptive-lookup": {"speculation": "adaptive"},
            "fixed-k4": {"speculation": "fixed", "num_speculative_tokens": 4, "assistant_model": drf}, "plain": {}}
    with cs.forward_timer((tgt, drf)) as timer:
        out = {name: cs.engine_overhead(tgt, timer, prompt, new, kwargs) for name, kwargs in runs.items()}
    spec = statistics.median(v["engine_ms_per_step"] for k, v in out.items() if k != "plain")
    check.facts["overheads"] = (spec, out["plain"]["engine_ms_per_step"])
    a = out["adaptive"]
    share = a["engine_ms_per_step"] / a["target_ms_per_forward"]
    return {"passed": None, "quantization": q, "runs": out, "over_10pct": share > 0.10,
            "overheads_ms": check.facts["overheads"],
            "summary": f"{QUANT_LABEL[q]} adaptive: engine {a['engine_ms_per_step']} ms/step = {share:.1%} of the "
                       f"target's {a['target_ms_per_forward']} ms forward; plain: transformers "
                       f"{out['plain']['engine_ms_per_step']} ms/token"}


def replay(check: Check) -> dict:
    """Projections: the committed held-out traces of Spec-Bench and the code workload (60, greedy, Qwen2.5-Coder
    1.5B/0.5B traced on a CPU) replayed on every profile in the output folder (plain, fixed-k, adaptive,
    adaptive-lookup) at batch 1, 2, 4, 8, with the engine overheads measured on the GPU (else none). Predicted,
    not measured; the acceptance is the CPU-traced pair's, for the 7B target too."""
    from . import bench as bm
    from .replay import Clock
    from .replay_report import replay_all
    from .trace import load_traces

    traces = [t for t in load_traces(TRACES) if t.split == "held-out" and t.source in ("spec_bench", "code")]
    traces, overheads, tables = traces[:2] if check.tiny else traces, check.facts.get("overheads", (0.0, 0.0)), {}
    for path in sorted(check.out.glob("*/profile.json")):
        clock = Clock(load_profile(path), *overheads)
        for b in (1, 2) if check.tiny else (1, 2, 4, 8):
            result = replay_all(traces, REPLAY_METHODS, clock, b)
            overall = bm.summarize(result.runs, list(REPLAY_METHODS), result.oracles)["table"]["overall"]
            tables.setdefault(path.parent.name, {})[f"b{b}"] = {
                "plain_tokens_per_s": round(overall["plain"]["tokens_per_s"], 2),
                "all_match_traces": all(r.matches_plain for r in result.runs),
                **{m: round(overall[m]["speedup"], 3) for m in REPLAY_METHODS[1:]}}
    if not tables:
        raise FileNotFoundError(f"no */profile.json under {check.out}: run the profile steps first")
    return {"passed": all(r["all_match_traces"] for t in tables.values() for r in t.values()),
            "kind": "projection (replay on the profiles; acceptance of the CPU-traced 1.5B/0.5B pair)",
            "traces": len(traces), "overheads_ms": overheads, "tables": tables,
            "summary": "projected speedup of adaptive over plain at batch 1: " + ", ".join(
                f"{k} {v['b1']['adaptive']}x" for k, v in tables.items())}


@dataclasses.dataclass(frozen=True)
class Step:
    """A named step; on a GPU it is not started with less than ``needs_s`` of the budget left."""

    name: str
    run: Callable[[Check], dict]
    needs_s: float = 0.0
    on_gpu: bool = True  # False: CPU work, skipped on a GPU (run it later with --device cpu --steps NAME)


def plan() -> list[Step]:
    """The steps in order: the cheap correctness checks first; each quantization's models loaded once for its
    greedy, self-draft and profile steps; the 7B last but the replay."""
    steps = [Step("environment", environment), Step("sampling", sampling, 20)]
    for q, label in QUANT_LABEL.items():
        steps += [Step(f"greedy-{label}", lambda c, q=q: cs.greedy_matrix(c, q), 45),
                  Step(f"self-draft-{label}", lambda c, q=q: cs.self_draft(c, q), 20),
                  Step(f"profile-1.5b-{label}", lambda c, q=q: profile_pair(c, TARGET, q), 45)]
    steps += [Step("never-loses", never_loses, 45), Step("engine", engine_time, 15),
              Step("profile-7b-nf4", lambda c: profile_pair(c, BIG, "nf4"), 120),
              Step("profile-7b-bf16", lambda c: profile_pair(c, BIG, "none"), 80)]
    return steps + [Step("replay", replay, on_gpu=False)]


def _run_one(check: Check, step: Step) -> dict:
    start = time.perf_counter()
    try:
        details = step.run(check)
        status = "failed" if details.get("passed") is False else "ok"
    except Exception as e:  # noqa: BLE001 - a step's error is recorded and the next step runs
        status, details = "error", {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    return {"status": status, "seconds": round(time.perf_counter() - start, 1), **details}


def run_steps(check: Check, steps: list[Step], budget_s: float, merge: bool = False) -> dict:
    """Run ``steps`` in order within ``budget_s`` seconds, rewriting the results after each; ``merge``: into
    the existing results file (whose engine overheads then serve the replay)."""
    old = check.out / RESULTS
    doc = json.loads(old.read_text()) if merge and old.is_file() else {"steps": {}}
    if "overheads_ms" in doc["steps"].get("engine", {}):
        check.facts.setdefault("overheads", tuple(doc["steps"]["engine"]["overheads_ms"]))
    label = check.facts.get("gpu") or check.device
    if "device" not in doc:  # a merged run keeps the labels of the run it adds to
        doc.update(check="hf-adaspec gpu-check (issue 36)", device=check.device, device_label=label, tiny=check.tiny,
                   budget_s=budget_s)
    doc["finished"] = False
    write_results(check.out, doc)
    start = time.perf_counter()
    for step in steps:
        left = budget_s - (time.perf_counter() - start)
        if not step.on_gpu and check.device != "cpu" and not merge:
            entry = {"status": "skipped: CPU work", "seconds": 0, "summary": "run it on a CPU: python -m "
                     f"hf_adaspec.tools.gpu_check --device cpu --steps {step.name} --out {check.out}"}
        elif left <= 0 or (check.device != "cpu" and left < step.needs_s):
            entry = {"status": "skipped: budget", "seconds": 0, "left_s": round(left, 1)}
        else:
            entry = _run_one(check, step)
        doc["steps"][step.name] = {**entry, "ran_on": label}
        write_results(check.out, doc)
        print(f"[gpu-check] {step.name}: {entry['status']} ({entry['seconds']} s) "
              f"{entry.get('summary', entry.get('error', ''))}", flush=True)
    doc["finished"] = True
    write_results(check.out, doc)
    return doc


def main(argv: list[str] | None = None) -> int:
    """The command line; exit status 1 when a step failed or raised."""
    parser = argparse.ArgumentParser(prog="python -m hf_adaspec.tools.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--out", type=Path, help="results folder (default model_cards/gpu/<device name>)")
    parser.add_argument("--tiny", action="store_true", help="shrunk configs and grids (the CPU test)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds after which the rest is skipped")
    parser.add_argument("--steps", default="", help="comma-separated step names, merged into the results file")
    args = parser.parse_args(argv)
    wanted, names = [s for s in args.steps.split(",") if s], [s.name for s in plan()]
    if set(wanted) - set(names):
        parser.error(f"--steps {args.steps!r}: choose from {', '.join(names)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU); "
                     "try --device cpu --tiny")
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    out = args.out or Path("model_cards") / "gpu" / re.sub(r"[^a-z0-9]+", "-", (gpu or args.device).lower()).strip("-")
    check, threads = Check(args.device, args.tiny, out, facts={"gpu": gpu}), torch.get_num_threads()
    if args.tiny and args.device == "cpu":
        torch.set_num_threads(1)  # tiny tensors: thread spin-up would dominate
    try:
        doc = run_steps(check, [s for s in plan() if not wanted or s.name in wanted], args.budget_s, bool(wanted))
    finally:
        torch.set_num_threads(threads)
    bad = [n for n, e in doc["steps"].items() if e["status"] in ("failed", "error")]
    print(json.dumps({"results": str(out / RESULTS), "summary": str(out / SUMMARY), "failed": bad}), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
