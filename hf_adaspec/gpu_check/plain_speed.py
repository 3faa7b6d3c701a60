"""The GPU check's steps about plain steps at transformers' compiled speed (on an H200 hf-adaspec's plain step ran
0.82–0.90x transformers' static-compiled one, 1.5B bf16): the target's recorded widths compiled (``compile_target``)
and where the engine's own time per step goes (``engine_profile``).

Design: hf-adaspec's plain step is a recorded forward plus the engine's own time; transformers' static-compiled
plain is one compiled forward. ``compile_steps(target, TARGET_WIDTHS)`` records the target's widths after
``torch.compile`` (each width keeps the compiled recording only where it replays faster, ``static_kv``); the
step times it as whole requests against the same weights recorded plainly and against transformers, interleaved
per request with A/As, as ``speed`` does. The engine's own time is profiled by function (cProfile) on the GPU,
since a CPU's stand-in recordings put other costs in its place.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from pathlib import Path

from ..api.generate import TARGET_WIDTHS, compile_steps, enable
from ..backend.arenas import arenas_of
from ..engine.run import SpeculationState
from ..models.architecture import load_random
from . import steps as cs
from . import timing
from .speed import SPEED_PROMPT, WIN_MARGIN, speedup
from .steps import DRAFT, TARGET, Check, label

PLAIN_VS_COMPILED = 1.0  # the bar: hf-adaspec's plain (compiled target) / transformers' static-compiled plain
COMPILE_ROUNDS = 3  # timed rounds of compile-target (one untimed warm-up round before them)
PROFILE_TOP = 20  # functions kept per profiled request


def _twin(check: Check) -> object:
    """A second bf16 instance of the 1.5B target's random weights (its arenas and compiled widths its own)."""
    model = load_random(check.weights[TARGET], "none", "bfloat16", check.device)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return enable(model)


def compile_target(check: Check) -> dict:
    """The 1.5B bf16 target with its recorded widths compiled (``TARGET_WIDTHS``; not with --tiny, where the
    same code runs plain recordings), against the same weights recorded plainly and transformers'
    static-compiled plain: batch 1, greedy, 64 tokens, never-loses' 6 prompts, ``COMPILE_ROUNDS`` timed rounds
    interleaved per request; hf-adaspec's plain twice on each target (the A/As) and ``adaptive`` with the
    random-weight draft on the compiled one. Reported: tokens/s, ratios, per-round ratios, each width's
    recordings (plain and compiled replay ms, which was kept) and the first requests' seconds (compiling).
    Bars (not with --tiny): the compiled target's plain ≥ ``PLAIN_VS_COMPILED`` × transformers' and its adaptive
    ≥ ``WIN_MARGIN`` × its plain."""
    if (reason := cs.unusable(check, "none")) is not None:
        return {"passed": None, "fallback": True, "summary": reason}
    tgt, drf = check.model(TARGET, "none"), check.model(DRAFT, "none", head=True)
    fused = _twin(check)
    compile_steps(fused, () if check.tiny else TARGET_WIDTHS)
    try:
        plain = check.spec(speculation="fixed", num_speculative_tokens=0)
        methods = {
            "hf-compiled": {"cache_implementation": "static"},
            "plain": plain,
            "plain-again": plain,
            "plain-compiled": plain,
            "plain-compiled-again": plain,
            "adaptive-compiled": check.spec(speculation="adaptive", assistant_model=drf),
        }
        targets = {
            m: fused for m in methods if m.endswith(("-compiled", "-compiled-again")) and not m.startswith("hf-")
        }
        vocab, new = tgt.config.vocab_size, 12 if check.tiny else 64
        prompts = cs.speed_prompts(vocab, SPEED_PROMPT, seed=7) + cs.speed_prompts(vocab, SPEED_PROMPT, seed=8)
        first = {}
        for name, model in (("hf-compiled", tgt), ("plain-compiled", fused)):
            start = time.perf_counter()
            cs.generate(model, prompts[0], new, methods[name], SpeculationState())  # compiles (and records)
            first[name] = round(time.perf_counter() - start, 1)
        seconds = timing.timed_seconds(tgt, methods, prompts, new, 1 if check.tiny else COMPILE_ROUNDS, targets)
        records = [r.__dict__ for r in arenas_of(fused).records()]
    finally:
        compile_steps(fused, ())
        arenas_of(fused).drop()
    tps = {m: round(timing.tokens_per_s(seconds[m], new), 2) for m in methods}
    pairs = (
        ("plain-again", "plain"),
        ("plain-compiled-again", "plain-compiled"),
        ("plain-compiled", "plain"),
        ("plain", "hf-compiled"),
        ("plain-compiled", "hf-compiled"),
        ("adaptive-compiled", "plain-compiled"),
    )
    ratio = {f"{a}/{b}": round(tps[a] / tps[b], 3) for a, b in pairs}
    rounds = {f"{a}/{b}": [speedup(x, y) for x, y in zip(seconds[b], seconds[a], strict=True)] for a, b in pairs}
    kept = sorted({r["width"] for r in records if r["compiled"] and r["kept"]})
    bars = {
        "plain_vs_hf_compiled": ratio["plain-compiled/hf-compiled"] >= PLAIN_VS_COMPILED,
        "never_loses": ratio["adaptive-compiled/plain-compiled"] >= WIN_MARGIN,
    }
    line = (
        f"bf16 tokens/s ({len(prompts)} prompts × {len(seconds['plain'])} rounds): "
        + ", ".join(f"{m} {v}" for m, v in tps.items())
        + "; "
        + ", ".join(f"{k} {v}" for k, v in ratio.items())
        + f"; widths kept compiled {kept} of {sorted({r['width'] for r in records})}; first requests (s): "
        + ", ".join(f"{k} {v}" for k, v in first.items())
        + ("; not judged (--tiny)" if check.tiny else "")
    )
    return {
        "passed": None if check.tiny else all(bars.values()),
        "tokens_per_s": tps,
        "ratios": ratio,
        "per_round": rounds,
        "bars": bars,
        "records": records,
        "widths_kept_compiled": kept,
        "first_request_s": first,
        "compiled_widths": [] if check.tiny else list(TARGET_WIDTHS),
        "summary": line,
    }


def _top(profiler: cProfile.Profile, steps: int) -> list[dict]:
    """The ``PROFILE_TOP`` functions with the most own time: ms and calls per step, own and cumulative."""
    rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda kv: kv[1][2], reverse=True)[:PROFILE_TOP]
    return [
        {
            "function": f"{Path(file).name}:{line}({func})",
            "calls_per_step": round(nc / steps, 2),
            "own_ms_per_step": round(tt * 1000 / steps, 4),
            "cum_ms_per_step": round(ct * 1000 / steps, 4),
        }
        for (file, line, func), (_, nc, tt, ct, _) in rows
    ]


def engine_profile(check: Check, q: str) -> dict:
    """Where a step's time goes on this device, by function: cProfile over one greedy request at batch 1 (128
    tokens, after an untimed one that records its widths) of hf-adaspec's plain and of ``adaptive`` with the
    random-weight draft, deciding every step (``rest=False``). Per request: steps, wall ms per step under the
    profiler and the top functions by own time (a device synchronisation's wait shows in the function that
    synchronises; cProfile's own cost inflates Python's share: read the ranking, not the sum)."""
    if (reason := cs.unusable(check, q)) is not None:
        return {"passed": None, "fallback": True, "summary": reason}
    tgt, drf = check.model(TARGET, q), check.model(DRAFT, q, head=True)
    prompt, new = cs.check_prompts(tgt.config.vocab_size, seed=6)[0], 12 if check.tiny else 128
    runs = {
        "plain": check.spec(speculation="fixed", num_speculative_tokens=0),
        "adaptive": check.spec(speculation="adaptive", assistant_model=drf, rest=False),
    }
    out = {}
    for name, kwargs in runs.items():
        cs.generate(tgt, prompt, new, kwargs)  # records the widths this request uses
        profiler = cProfile.Profile()
        timing.sync(tgt)
        start = time.perf_counter()
        profiler.enable()
        stats = cs.generate(tgt, prompt, new, kwargs, SpeculationState()).speculation
        timing.sync(tgt)
        profiler.disable()
        steps = len({s.step for s in stats.steps})
        out[name] = {
            "steps": steps,
            "wall_ms_per_step": round((time.perf_counter() - start) * 1000 / steps, 3),
            "top": _top(profiler, steps),
        }
    line = "; ".join(
        f"{label(q)} {name} ({r['wall_ms_per_step']} ms/step profiled): "
        + ", ".join(f"{t['function']} {t['own_ms_per_step']}" for t in r["top"][:5])
        for name, r in out.items()
    )
    return {"passed": None, "quantization": q, "runs": out, "summary": line + " (own ms per step)"}
