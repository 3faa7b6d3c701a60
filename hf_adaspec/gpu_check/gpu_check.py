"""``make gpu-check``: one prepared pass over what only a GPU can tell (issues 36, 43), proven on the CPU first.

``python -m hf_adaspec.gpu_check --device cuda [--out DIR] [--budget-s 480]`` runs the steps of ``plan``
in order, each in its own try/except, and rewrites ``gpu_check.json`` (atomically) and ``gpu_check.md`` after
every step, so a run cut off by its time limit still leaves what finished; once the budget is spent the
rest is recorded as "skipped: budget". Every model has a preset's architecture (``models/configs``, the 7B's
too) and seeded random weights. ``--tiny``: shrunk configs and grids (tests/test_gpu_check.py, on the CPU).
``--kv-cache``: where speculation keeps its caches (default auto: arenas whose narrow forwards replay CUDA
graphs on a GPU; the CPU test passes static, whose recordings are re-run there).
``--steps a,b``: only those, merged into an existing results file (e.g. ``--steps replay`` on a CPU, from
the profiles a GPU run left: the replay is CPU work, skipped on a GPU).

Steps: environment (versions, the GPU; NF4 only if bitsandbytes' kernels load, else every NF4 step records
the bf16 fallback); graphs (``graphs``: replayed recordings against eager forwards, capture costs);
sampling (``sampling``: chi-square test of lossless sampling); per quantization (bf16, NF4) greedy
(speculative greedy = plain greedy or a near-tie), self-draft (acceptance away from near-ties), the shipped
pair's profile, speed (``speed``; wall clock, interleaved: transformers' eager and compiled plain,
hf-adaspec's plain, fixed and adaptive; ``adaptive`` with the self-draft within 3% of ``fixed``), never-loses
(``adaptive`` with the random-weight draft within 3% of hf-adaspec's plain, timed for that bar alone, with its
A/A); compile-draft (the draft's step recorded after torch.compile, timed); the 7B target's profiles with the
0.5B draft; engine (the engine's own ms per step, wall less the forwards); replay (projections on every
profile, batch 1, 2, 4, 8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import re
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from ..api.generate import compile_steps
from ..config import KV_CACHES
from ..costs.measure import ProfileGrid, measure_profile, pair_name, plot_profile
from ..costs.profile import load_profile, save_profile
from ..costs.table import processor_name
from . import steps as cs
from .graphs import compile_draft, graphs, head_graphs
from .report import REPLAY_METHODS, RESULTS, SUMMARY, write_results
from .sampling import sampling
from .speed import engine_time, never_loses, speed
from .steps import BIG, DRAFT, QUANT_LABEL, TARGET, Check

BUDGET_S = 480.0
TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"
GPU_GRID = ProfileGrid(new_tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16), batch_sizes=(1, 2, 4, 8),
                       contexts=(128, 512, 2048), repeats=2)
TINY_GRID = ProfileGrid(new_tokens=(1, 2, 3), batch_sizes=(1, 2), contexts=(16, 32), repeats=1)


def environment(check: Check) -> dict:
    """Versions and the device; NF4 stays only if bitsandbytes imports and a 4-bit round trip runs here."""
    import transformers

    gpu = torch.cuda.get_device_name(0) if check.device.startswith("cuda") else None
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
            "python": platform.python_version(), "device": check.device, "gpu": gpu, "cpu": processor_name(),
            "kv_cache": check.kv_cache,
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


def profile_pair(check: Check, target: str, quantization: str, compiled_draft: bool = False) -> dict:
    """``hf-adaspec profile --random-weights`` of (target, the 0.5B draft) in one quantization, saved as
    ``<out>/<pair>-<nf4|bf16>/profile.json`` (its command names the GPU); the costs that matter read back.
    ``compiled_draft``: the draft's 1-token forward recorded after torch.compile, batch 1 only, saved as
    ``<pair>-<q>-compiled-draft``."""
    if quantization not in check.quantizations:
        return {"passed": None, "fallback": True, "summary": check.fallback}
    if target == BIG:
        check.drop(keep=[k for k in check.models if k[0] == DRAFT and k[1] == quantization])
    tgt, drf = check.model(target, quantization), check.model(DRAFT, quantization, head=True)
    grid, pair, csv = TINY_GRID if check.tiny else GPU_GRID, pair_name(target, DRAFT), lambda v: ",".join(map(str, v))
    grid = dataclasses.replace(grid, batch_sizes=(1,)) if compiled_draft else grid
    command = (f"hf-adaspec profile --target {target} --draft {DRAFT} --quantization {quantization} --dtype bfloat16 "
               f"--contexts {csv(grid.contexts)} --batch-sizes {csv(grid.batch_sizes)} --new-tokens "
               f"{csv(grid.new_tokens)} --repeats {grid.repeats} --max-tokens-per-forward "
               f"{grid.max_tokens_per_forward} --device {check.device} --random-weights --kv-cache {check.kv_cache}"
               + (" --compile-draft" if compiled_draft else "")
               + f"  # by hf_adaspec.gpu_check on {check.facts.get('gpu') or check.device}")
    compile_steps(drf, (1,) if compiled_draft else ())
    try:
        profile = measure_profile(tgt, drf, grid, pair, command, kv_cache=check.kv_cache)
    finally:
        compile_steps(drf, ())
    folder = f"{pair}-{QUANT_LABEL[quantization]}" + ("-compiled-draft" if compiled_draft else "")
    path = save_profile(profile, check.out / folder / "profile.json")
    try:
        plot_profile(profile, path.with_name("cost_curves.png"))
    except ImportError:
        pass
    c = 32 if check.tiny else 512
    costs = {f"b{b}": {"verify_ms_n1": round(profile.verify_ms(b, c, 1), 2), "verify_ms_n5": round(
        profile.verify_ms(b, c, 5), 2), "draft_ms": round(profile.draft_ms(b, c), 2)} for b in grid.batch_sizes}
    ratio, b1 = profile.draft_ms(1, c) / profile.verify_ms(1, c, 1), costs["b1"]
    check.facts[f"verify_ms_n1 {target} {quantization}"] = profile.verify_ms(1, c, 1)
    heads = (tgt.get_output_embeddings().out_features, drf.get_output_embeddings().out_features)
    vocab = "" if heads[0] == heads[1] else f"; output heads {heads[0]} vs {heads[1]}: " + _pair_refused(tgt, drf)
    return {"passed": None, "path": str(path), "context": c, "costs": costs, "draft_over_target_b1": round(ratio, 3),
            "heads": heads, "summary": f"{path.parent.name}: at batch 1 and context {c} the target's forward over 1 "
                                       f"token {b1['verify_ms_n1']} ms, over 5 {b1['verify_ms_n5']} ms, the draft's "
                                       f"token {b1['draft_ms']} ms ({ratio:.2f} of the target's){vocab}"}


def _pair_refused(target, draft) -> str:
    """Whether ``generate`` takes (target, draft) as a pair, asked with one token."""
    try:
        cs.generate(target, [1, 2, 3], 1, {"speculation": "adaptive", "assistant_model": draft, "kv_cache": "dynamic"})
    except ValueError as e:
        return f"generate refuses the pair ({e}); the profile does not depend on it"
    return "generate takes the pair"


def replay(check: Check) -> dict:
    """Projections: the committed held-out traces of Spec-Bench and the code workload (60, greedy, Qwen2.5-Coder
    1.5B/0.5B traced on a CPU) replayed on every profile in the output folder (plain, fixed-k, adaptive,
    adaptive-lookup) at batch 1, 2, 4, 8, with the engine overheads measured on the GPU (else none). Predicted,
    not measured; the acceptance is the CPU-traced pair's, for the 7B target too."""
    from ..bench import bench as bm
    from ..replay.replay import Clock
    from ..replay.report import replay_all
    from ..replay.trace import load_traces

    traces = [t for t in load_traces(TRACES) if t.split == "held-out" and t.source in ("spec_bench", "code")]
    traces, overheads, tables = traces[:2] if check.tiny else traces, check.facts.get("overheads", (0.0, 0.0)), {}
    for path in sorted(check.out.glob("*/profile.json")):
        clock = Clock(load_profile(path), *overheads, prefill="profile")
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
    """The steps in order: the cheap correctness checks first (recorded forwards against eager ones, sampling,
    greedy and the self-draft in bf16); the 1.5B pair's bf16 profile, the side-by-side timing, never-loses, the
    engine's own time, the 7B's bf16 profile and the draft's compiled step; then NF4; the replay last (CPU work)."""
    return [Step("environment", environment), Step("graphs", graphs, 15), Step("head-graphs", head_graphs, 15),
            Step("sampling", sampling, 20),
            Step("greedy-bf16", lambda c: cs.greedy_matrix(c, "none"), 40),
            Step("self-draft-bf16", lambda c: cs.self_draft(c, "none"), 15),
            Step("profile-1.5b-bf16", lambda c: profile_pair(c, TARGET, "none"), 40),
            Step("speed-bf16", lambda c: speed(c, "none"), 150),
            Step("never-loses-bf16", lambda c: never_loses(c, "none"), 60),
            Step("engine-bf16", lambda c: engine_time(c, "none"), 15),
            Step("profile-7b-bf16", lambda c: profile_pair(c, BIG, "none"), 60),
            Step("compile-draft", compile_draft, 60),
            Step("profile-7b-bf16-compiled-draft", lambda c: profile_pair(c, BIG, "none", compiled_draft=True), 90),
            Step("greedy-nf4", lambda c: cs.greedy_matrix(c, "nf4"), 40),
            Step("self-draft-nf4", lambda c: cs.self_draft(c, "nf4"), 15),
            Step("profile-1.5b-nf4", lambda c: profile_pair(c, TARGET, "nf4"), 45),
            Step("speed-nf4", lambda c: speed(c, "nf4"), 45),
            Step("never-loses-nf4", lambda c: never_loses(c, "nf4"), 60),
            Step("profile-7b-nf4", lambda c: profile_pair(c, BIG, "nf4"), 60),
            Step("replay", replay, on_gpu=False)]


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
    if "overheads_ms" in doc["steps"].get("engine-bf16", {}):
        check.facts.setdefault("overheads", tuple(doc["steps"]["engine-bf16"]["overheads_ms"]))
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
                     f"hf_adaspec.gpu_check --device cpu --steps {step.name} --out {check.out}"}
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
    parser = argparse.ArgumentParser(prog="python -m hf_adaspec.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--out", type=Path, help="results folder (default model_cards/gpu/<device name>)")
    parser.add_argument("--tiny", action="store_true", help="shrunk configs and grids (the CPU test)")
    parser.add_argument("--budget-s", type=float, default=BUDGET_S, help="seconds after which the rest is skipped")
    parser.add_argument("--steps", default="", help="comma-separated step names, merged into the results file")
    parser.add_argument("--kv-cache", default="auto", choices=KV_CACHES,
                        help="where speculation keeps its caches (auto: recorded CUDA graphs on a GPU)")
    args = parser.parse_args(argv)
    wanted, names = [s for s in args.steps.split(",") if s], [s.name for s in plan()]
    if set(wanted) - set(names):
        parser.error(f"--steps {args.steps!r}: choose from {', '.join(names)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU); "
                     "try --device cpu --tiny")
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    out = args.out or Path("model_cards") / "gpu" / re.sub(r"[^a-z0-9]+", "-", (gpu or args.device).lower()).strip("-")
    check, threads = Check(args.device, args.tiny, out, args.kv_cache, facts={"gpu": gpu}), torch.get_num_threads()
    if args.tiny and args.device == "cpu":
        torch.set_num_threads(1)  # tiny tensors: thread spin-up would dominate
    try:
        doc = run_steps(check, [s for s in plan() if not wanted or s.name in wanted], args.budget_s, bool(wanted))
    finally:
        torch.set_num_threads(threads)
    bad = [n for n, e in doc["steps"].items() if e["status"] in ("failed", "error")]
    print(json.dumps({"results": str(out / RESULTS), "summary": str(out / SUMMARY), "failed": bad}), flush=True)
    return 1 if bad else 0

