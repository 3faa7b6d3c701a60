"""The GPU check's cost profiles and the projections on them: ``profile_pair`` measures a (target, 0.5B draft)
profile with random weights (``hf-adaspec profile --random-weights``), ``replay`` projects the speedups of
``adaptive`` and the other methods on every profile of the run by replaying committed CPU traces (CPU work, run
after the GPU steps). The 7B's 4-bit profile (``quantized``) is held to its projection bars here (``WORKLOAD_BARS``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..api.generate import compile_steps
from ..costs.measure import ProfileGrid, measure_profile, pair_name, plot_profile
from ..costs.profile_files import load_profile, save_profile
from . import steps as cs
from .report import REPLAY_METHODS
from .steps import BIG, DRAFT, Check, label

TRACES = Path(__file__).resolve().parents[2] / "benchmarks" / "traces"
GPU_GRID = ProfileGrid(
    new_tokens=(1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16), batch_sizes=(1, 2, 4, 8), contexts=(128, 512, 2048), repeats=2
)
TINY_GRID = ProfileGrid(new_tokens=(1, 2, 3), batch_sizes=(1, 2), contexts=(16, 32), repeats=1)
WORKLOAD_BARS = {"spec_bench": 1.5, "code": 4.0}  # projected adaptive/plain at batch 1 for the 7B's 4-bit profile
FOUR_BIT_PROFILE = "profile 7b 4-bit"  # check.facts: the folder of the 7B's 4-bit profile (``quantized``)


def profile_pair(
    check: Check, target: str, quantization: str, compiled_draft: bool = False, draft_quantization: str | None = None
) -> dict:
    """``hf-adaspec profile --random-weights`` of (target, the 0.5B draft) in one quantization (the draft in
    ``draft_quantization``, default the same), saved as ``<out>/<pair>-<label>/profile.json`` (its command names
    the GPU); the costs that matter read back. ``compiled_draft``: the draft's 1-token forward recorded after
    torch.compile, batch 1 only, saved as ``<pair>-<label>-compiled-draft``."""
    draft_quantization = draft_quantization or quantization
    for q in {quantization, draft_quantization}:
        if (reason := cs.unusable(check, q)) is not None:
            return {"passed": None, "fallback": True, "summary": reason}
    if target == BIG:
        check.drop(keep=[k for k in check.models if k[0] == DRAFT and k[1] == draft_quantization])
    drf = check.model(DRAFT, draft_quantization, head=True)
    tgt = check.model(target, quantization, keep_others=True)
    grid, pair, csv = TINY_GRID if check.tiny else GPU_GRID, pair_name(target, DRAFT), lambda v: ",".join(map(str, v))
    grid = dataclasses.replace(grid, batch_sizes=(1,)) if compiled_draft else grid
    draft_note = f", the draft in {label(draft_quantization)}" if draft_quantization != quantization else ""
    command = (
        f"hf-adaspec profile --target {target} --draft {DRAFT} --quantization {quantization} --dtype bfloat16 "
        f"--contexts {csv(grid.contexts)} --batch-sizes {csv(grid.batch_sizes)} --new-tokens "
        f"{csv(grid.new_tokens)} --repeats {grid.repeats} --max-tokens-per-forward "
        f"{grid.max_tokens_per_forward} --device {check.device} --random-weights --kv-cache {check.kv_cache}"
        + (" --compile-draft" if compiled_draft else "")
        + f"  # by hf_adaspec.gpu_check on {check.facts.get('gpu') or check.device}{draft_note}"
    )
    compile_steps(drf, (1,) if compiled_draft else ())
    try:
        profile = measure_profile(tgt, drf, grid, pair, command, kv_cache=check.kv_cache)
    finally:
        compile_steps(drf, ())
    folder = f"{pair}-{label(quantization)}" + ("-compiled-draft" if compiled_draft else "")
    path = save_profile(profile, check.out / folder / "profile.json")
    try:
        plot_profile(profile, path.with_name("cost_curves.png"))
    except ImportError:
        pass
    c = 32 if check.tiny else 512
    costs = {
        f"b{b}": {
            "verify_ms_n1": round(profile.verify_ms(b, c, 1), 2),
            "verify_ms_n5": round(profile.verify_ms(b, c, 5), 2),
            "draft_ms": round(profile.draft_ms(b, c), 2),
        }
        for b in grid.batch_sizes
    }
    ratio, b1 = profile.draft_ms(1, c) / profile.verify_ms(1, c, 1), costs["b1"]
    check.facts[f"verify_ms_n1 {target} {quantization}"] = profile.verify_ms(1, c, 1)
    heads = (tgt.get_output_embeddings().out_features, drf.get_output_embeddings().out_features)
    vocab = "" if heads[0] == heads[1] else f"; output heads {heads[0]} vs {heads[1]}: " + _pair_refused(tgt, drf)
    return {
        "passed": None,
        "path": str(path),
        "context": c,
        "costs": costs,
        "draft_over_target_b1": round(ratio, 3),
        "heads": heads,
        "summary": f"{path.parent.name}: at batch 1 and context {c} the target's forward over 1 "
        f"token {b1['verify_ms_n1']} ms, over 5 {b1['verify_ms_n5']} ms, the draft's "
        f"token {b1['draft_ms']} ms ({ratio:.2f} of the target's){vocab}",
    }


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
    adaptive-lookup) at batch 1, 2, 4, 8, with the engine overheads measured on the GPU (else none); at batch 1
    also per workload. Predicted, not measured; the acceptance is the CPU-traced pair's, for the 7B target too.
    The 7B's 4-bit profile (``FOUR_BIT_PROFILE``) is held to ``WORKLOAD_BARS`` (not with --tiny)."""
    from ..bench.summary import summarize
    from ..replay.clock import Clock
    from ..replay.report import replay_all
    from ..replay.trace import load_traces

    traces = [t for t in load_traces(TRACES) if t.split == "held-out" and t.source in WORKLOAD_BARS]
    traces, overheads, tables = traces[:2] if check.tiny else traces, check.facts.get("overheads", (0.0, 0.0)), {}

    def speedups(subset, clock, b) -> dict:
        result = replay_all(subset, REPLAY_METHODS, clock, b)
        overall = summarize(result.runs, list(REPLAY_METHODS), result.oracles)["table"]["overall"]
        return {
            "plain_tokens_per_s": round(overall["plain"]["tokens_per_s"], 2),
            "all_match_traces": all(r.matches_plain for r in result.runs),
            **{m: round(overall[m]["speedup"], 3) for m in REPLAY_METHODS[1:]},
        }

    for path in sorted(check.out.glob("*/profile.json")):
        clock = Clock(load_profile(path), *overheads, prefill="profile")
        rows = tables.setdefault(path.parent.name, {})
        for b in (1, 2) if check.tiny else (1, 2, 4, 8):
            rows[f"b{b}"] = speedups(traces, clock, b)
        rows["b1"]["workloads"] = {
            w: speedups([t for t in traces if t.source == w], clock, 1)["adaptive"]
            for w in sorted({t.source for t in traces})
        }
    if not tables:
        raise FileNotFoundError(f"no */profile.json under {check.out}: run the profile steps first")
    four_bit = tables.get(check.facts.get(FOUR_BIT_PROFILE, ""), {}).get("b1", {}).get("workloads")
    bars = {f"{w} >= {bar}x": four_bit[w] >= bar for w, bar in WORKLOAD_BARS.items() if w in (four_bit or {})}
    matched = all(r["all_match_traces"] for t in tables.values() for r in t.values())
    judged = not check.tiny and len(bars) == len(WORKLOAD_BARS)
    return {
        "passed": matched and (not judged or all(bars.values())),
        "kind": "projection (replay on the profiles; acceptance of the CPU-traced 1.5B/0.5B pair)",
        "traces": len(traces),
        "overheads_ms": overheads,
        "tables": tables,
        "bars": bars,
        "four_bit_profile": check.facts.get(FOUR_BIT_PROFILE),
        "summary": "projected speedup of adaptive over plain at batch 1: "
        + ", ".join(
            f"{k} {v['b1']['adaptive']}x ({', '.join(f'{w} {x}x' for w, x in v['b1']['workloads'].items())})"
            for k, v in tables.items()
        ),
    }
