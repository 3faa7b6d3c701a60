"""``make gpu-check``: one prepared pass over what only a GPU can tell, proven on the CPU first (a GPU is lent
now and then for minutes, without network, so the pass must work the first time: correctness on CUDA, step costs
there, whether ``adaptive`` wins there at all).

``python -m hf_adaspec.gpu_check --device cuda [--out DIR] [--budget-s 480]`` runs the steps of ``plan``
in order, each in its own try/except, and rewrites ``gpu_check.json`` (atomically) and ``gpu_check.md`` after
every step, so a run cut off by its time limit still leaves what finished; once the budget is spent the
rest is recorded as "skipped: budget". Every model has a preset's architecture (``models/configs``, the 7B's
too) and seeded random weights. ``--tiny``: shrunk configs and grids (tests/test_gpu_check.py, on the CPU).
``--kv-cache``: where speculation keeps its caches (default auto: arenas whose narrow forwards replay CUDA
graphs on a GPU; the CPU test passes static, whose recordings are re-run there).
``--steps a,b``: only those, merged into an existing results file (e.g. ``--steps replay`` on a CPU, from
the profiles a GPU run left: the replay is CPU work, skipped on a GPU). ``--isolation process`` (the default on a
GPU): each step runs in a process of its own (``processes``), so one step's CUDA error cannot poison the next.
The results record the run's ``provenance`` (commit: ``$HF_ADASPEC_COMMIT`` on a checkout without git, torch,
CUDA, driver, transformers, Python).

Steps: environment (versions, the GPU; NF4 only if bitsandbytes' kernels load, else every NF4 step records the bf16
fallback); graphs (``graphs``: replayed recordings against eager forwards, capture costs; capture-recovery: a
capture made to fail fails no request and leaves nothing behind); sampling (``sampling``: chi-square test of
lossless sampling); per quantization (bf16, NF4) greedy (speculative greedy = plain greedy or a near-tie),
self-draft (acceptance away from near-ties), the shipped pair's profile, speed (``speed``; wall clock, interleaved:
transformers' eager and compiled plain, hf-adaspec's plain, fixed and adaptive; ``adaptive`` with the self-draft
within 3% of ``fixed``), never-loses (``adaptive`` with the random-weight draft within 3% of hf-adaspec's plain,
timed for that bar alone, with its A/A); compile-draft (the draft's step recorded after torch.compile, timed); the
7B target's profiles with the 0.5B draft; engine (the engine's own ms per step, wall less the forwards) and
engine-profile (where that time goes, by function); formats-7b and profile-7b-4bit (``quantized``: the 7B's 4-bit
format chosen as ``auto`` chooses, and its profile against its bars: a verification over 5 tokens at most
``quantized.VERIFY_RATIO`` of a 1-token step, projected speed-ups ``profiles.WORKLOAD_BARS``); compile-target
(``speed.compile_target``: the target's recorded widths compiled, against plain recordings and transformers'
static-compiled plain); replay (``profiles``: projections on every profile, batch 1, 2, 4, 8, and per workload at
batch 1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from .. import machine
from ..config import KV_CACHES
from ..models.formats import FORMATS, missing_kernel, probed_for
from . import processes
from . import steps as cs
from .graphs import capture_recovery, compile_draft, graphs, head_graphs
from .plain_speed import compile_target, engine_profile
from .profiles import FOUR_BIT_PROFILE, profile_pair, replay
from .quantized import FOUR_BIT, formats_7b, profile_7b_4bit
from .report import RESULTS, SUMMARY, write_results
from .sampling import sampling
from .speed import engine_time, never_loses, speed
from .steps import BIG, TARGET, Check

BUDGET_S = 480.0


def environment(check: Check) -> dict:
    """Versions and the device; NF4 stays only if bitsandbytes imports and a 4-bit round trip runs here."""
    import transformers

    gpu = torch.cuda.get_device_name(0) if check.device.startswith("cuda") else None
    info = {
        **processes.provenance(),
        "device": check.device,
        "gpu": gpu,
        "cpu": machine.processor_name(),
        "kv_cache": check.kv_cache,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if gpu else None,
    }
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
    gpu_formats = [f for f in probed_for(check.device) if FORMATS[f].missing is not None]
    info["gpu_4bit"] = {f: missing_kernel(f, check.device) or "runs here" for f in gpu_formats}
    info["versions"] = machine.versions(*sorted({lib for f in gpu_formats for lib in FORMATS[f].libraries}))
    line = (
        f"{gpu or check.device}, torch {torch.__version__}, transformers {transformers.__version__}; {info['nf4']}"
        + "".join(f"; {f}: {why}" for f, why in info["gpu_4bit"].items())
    )
    return {**info, "passed": None, "summary": line}


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
    engine's own time and where it goes, the 7B's bf16 profile, its 4-bit formats and its profile in the chosen one,
    the target's recorded widths compiled, the draft's compiled step; then NF4; the replay last (CPU work)."""
    return [
        Step("environment", environment),
        Step("graphs", graphs, 15),
        Step("head-graphs", head_graphs, 15),
        Step("sampling", sampling, 20),
        Step("capture-recovery", capture_recovery, 15),
        Step("greedy-bf16", lambda c: cs.greedy_matrix(c, "none"), 40),
        Step("self-draft-bf16", lambda c: cs.self_draft(c, "none"), 15),
        Step("profile-1.5b-bf16", lambda c: profile_pair(c, TARGET, "none"), 40),
        Step("speed-bf16", lambda c: speed(c, "none"), 150),
        Step("never-loses-bf16", lambda c: never_loses(c, "none"), 60),
        Step("engine-bf16", lambda c: engine_time(c, "none"), 15),
        Step("engine-profile-bf16", lambda c: engine_profile(c, "none"), 20),
        Step("profile-7b-bf16", lambda c: profile_pair(c, BIG, "none"), 60),
        Step("formats-7b", formats_7b, 120),
        Step("profile-7b-4bit", profile_7b_4bit, 100),
        Step("compile-target", compile_target, 150),
        Step("compile-draft", compile_draft, 60),
        Step("profile-7b-bf16-compiled-draft", lambda c: profile_pair(c, BIG, "none", compiled_draft=True), 90),
        Step("greedy-nf4", lambda c: cs.greedy_matrix(c, "nf4"), 40),
        Step("self-draft-nf4", lambda c: cs.self_draft(c, "nf4"), 15),
        Step("profile-1.5b-nf4", lambda c: profile_pair(c, TARGET, "nf4"), 45),
        Step("speed-nf4", lambda c: speed(c, "nf4"), 45),
        Step("never-loses-nf4", lambda c: never_loses(c, "nf4"), 60),
        Step("profile-7b-nf4", lambda c: profile_pair(c, BIG, "nf4"), 60),
        Step("replay", replay, on_gpu=False),
    ]


def _run_one(check: Check, step: Step) -> dict:
    start = time.perf_counter()
    try:
        details = step.run(check)
        status = "failed" if details.get("passed") is False else "ok"
    except Exception as e:  # noqa: BLE001 - a step's error is recorded and the next step runs
        status, details = "error", {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=6)}
    return {"status": status, "seconds": round(time.perf_counter() - start, 1), **details}


def carried_facts(steps: dict) -> dict:
    """What later steps use from a results file's ``steps``: the engine's overheads (``engine-bf16``: the replay),
    the 7B's 4-bit format (``formats-7b``: its profile), that profile's folder (``profile-7b-4bit``: the replay's
    bars) and the bf16 7B's 1-token step (``profile-7b-bf16``: the 4-bit step's bar)."""
    facts, get = {}, lambda name, key: steps.get(name, {}).get(key)
    if get("engine-bf16", "overheads_ms"):
        facts["overheads"] = tuple(get("engine-bf16", "overheads_ms"))
    if get("formats-7b", "chosen_4bit"):
        facts[FOUR_BIT] = get("formats-7b", "chosen_4bit")
    if get("profile-7b-4bit", "path"):
        facts[FOUR_BIT_PROFILE] = Path(get("profile-7b-4bit", "path")).parent.name
    if get("profile-7b-bf16", "costs"):
        facts[f"verify_ms_n1 {BIG} none"] = get("profile-7b-bf16", "costs")["b1"]["verify_ms_n1"]
    return facts


def _carry(check: Check, steps: dict) -> None:
    """Give ``check`` what a results file's ``steps`` established: ``carried_facts``, and NF4's fallback where the
    environment step found bitsandbytes unusable."""
    for fact, value in carried_facts(steps).items():
        check.facts.setdefault(fact, value)
    nf4 = str(steps.get("environment", {}).get("nf4", ""))
    if nf4.startswith("FALLBACK"):
        check.quantizations, check.fallback = ("none",), nf4


def _isolated(check: Check, step: Step, left: float, doc: dict) -> dict:
    """``step`` run in a process of its own (``processes``), its entry read back from the results file."""
    doc["steps"].pop(step.name, None)
    write_results(check.out, doc)
    command = processes.child_command(check.device, check.out, step.name, left, check.kv_cache, check.tiny)
    return processes.run_in_child(command, check.out / RESULTS, step.name, left)


def run_steps(
    check: Check, steps: list[Step], budget_s: float, merge: bool = False, isolated: bool = False, child: bool = False
) -> dict:
    """Run ``steps`` in order within ``budget_s`` seconds, rewriting the results after each; ``merge``: into
    the existing results file (whose facts, ``carried_facts``, later steps use: the replay its engine overheads);
    ``isolated``: each step in a process of its own (``processes``: one step's CUDA error cannot reach the next);
    ``child``: this process is one such step's (the run's provenance is its parent's)."""
    old = check.out / RESULTS
    doc = json.loads(old.read_text()) if (merge or child) and old.is_file() else {"steps": {}}
    _carry(check, doc["steps"])
    label = check.facts.get("gpu") or check.device
    if "device" not in doc:  # a merged run keeps the labels of the run it adds to
        doc.update(check="make gpu-check", device=check.device, device_label=label, tiny=check.tiny, budget_s=budget_s)
    if not child:
        doc["provenance"] = processes.provenance()
    doc["finished"] = False
    write_results(check.out, doc)
    start = time.perf_counter()
    for step in steps:
        left = budget_s - (time.perf_counter() - start)
        if not step.on_gpu and check.device != "cpu" and not merge:
            entry = {
                "status": "skipped: CPU work",
                "seconds": 0,
                "summary": "run it on a CPU: python -m "
                f"hf_adaspec.gpu_check --device cpu --steps {step.name} --out {check.out}",
            }
        elif left <= 0 or (check.device != "cpu" and left < step.needs_s):
            entry = {"status": "skipped: budget", "seconds": 0, "left_s": round(left, 1)}
        elif isolated:
            entry = _isolated(check, step, left, doc)
        else:
            entry = _run_one(check, step)
        doc["steps"][step.name] = {**entry, "ran_on": label}
        write_results(check.out, doc)
        if not isolated:  # an isolated step's process printed its line
            print(
                f"[gpu-check] {step.name}: {entry['status']} ({entry['seconds']} s) "
                f"{entry.get('summary', entry.get('error', ''))}",
                flush=True,
            )
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
    parser.add_argument(
        "--kv-cache",
        default="auto",
        choices=KV_CACHES,
        help="where speculation keeps its caches (auto: recorded CUDA graphs on a GPU)",
    )
    parser.add_argument(
        "--isolation",
        choices=("process", "none"),
        help="process: each step in a process of its own (the default on a GPU); none: one process",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one step of an isolated run
    args = parser.parse_args(argv)
    wanted, names = [s for s in args.steps.split(",") if s], [s.name for s in plan()]
    if set(wanted) - set(names):
        parser.error(f"--steps {args.steps!r}: choose from {', '.join(names)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(
            "--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU); try --device cpu --tiny"
        )
    gpu = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else None
    out = args.out or Path("model_cards") / "gpu" / re.sub(r"[^a-z0-9]+", "-", (gpu or args.device).lower()).strip("-")
    check, threads = Check(args.device, args.tiny, out, args.kv_cache, facts={"gpu": gpu}), torch.get_num_threads()
    if args.tiny and args.device == "cpu":
        torch.set_num_threads(1)  # tiny tensors: thread spin-up would dominate
    isolated = (args.isolation or ("none" if args.device == "cpu" else "process")) == "process" and not args.child
    try:
        doc = run_steps(
            check,
            [s for s in plan() if not wanted or s.name in wanted],
            args.budget_s,
            bool(wanted),
            isolated,
            args.child,
        )
    finally:
        torch.set_num_threads(threads)
    bad = [n for n, e in doc["steps"].items() if e["status"] in ("failed", "error")]
    if not args.child:
        print(json.dumps({"results": str(out / RESULTS), "summary": str(out / SUMMARY), "failed": bad}), flush=True)
    return 1 if bad else 0
