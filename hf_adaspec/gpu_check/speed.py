"""The GPU check's clocks: wall clock of whole requests (``speed``: every method side by side;
``never_loses``: the never-loses bar with the samples it needs) and the engine's own time per step
(``engine_time``). ``gpu_check`` runs them as steps.

Design: a bar is judged against the noise of the same run. Every timing interleaves its methods per request
(``timing.timed_seconds``) and times hf-adaspec's plain twice, so the A/A ratio sits beside every
ratio. The never-loses bar (``adaptive`` with a random-weight draft at least ``WIN_MARGIN`` of plain) is a
difference of a few percent, so it has a step of its own with three methods and enough rounds and prompts
for that, and each round's ratio is reported: the spread a single round would have.
"""

from __future__ import annotations

import math
import statistics
import time

from ..costs.measure import pair_name
from . import steps as cs
from . import timing
from .steps import DRAFT, TARGET, Check, label

WIN_MARGIN = 0.97  # "within 3%"
COMPILED_MARGIN = 1 / 1.3  # adaptive (choosing plain steps) against transformers' static-compiled plain
SPEED_PROMPT = 24  # tokens: one length, so transformers' compiled static cache is compiled once
NEVER_LOSES_ROUNDS = 5  # timed rounds of the never-loses step (one untimed warm-up round before them)


def _profile_given(check: Check, quantization: str) -> dict:
    """``speculation_profile`` of the pair's profile where a profile step of this run saved one, else nothing
    (costs calibrated at first use)."""
    path = check.out / f"{pair_name(TARGET, DRAFT)}-{label(quantization)}" / "profile.json"
    return {"speculation_profile": str(path)} if path.is_file() else {}


def speed(check: Check, quantization: str) -> dict:
    """Wall clock, interleaved per request (batch 1, greedy, 64 tokens, 3 prompts of ``SPEED_PROMPT`` tokens):
    transformers' eager plain and (bf16) static-compiled plain (``cache_implementation="static"``, its first
    call, the compilation, timed apart), hf-adaspec's plain (``fixed`` k = 0) timed twice (the A/A), ``fixed``
    k = 4 and ``adaptive`` with the random-weight draft (acceptance ≈ 0: adaptive chooses plain steps),
    ``adaptive`` without a draft, and ``fixed`` k = 4 and ``adaptive`` with the target as its own draft; the
    arenas' recordings (widths, first-use ms). Bars (not with --tiny): adaptive with the self-draft ≥
    ``WIN_MARGIN`` of fixed's, adaptive with the random draft ≥ ``COMPILED_MARGIN`` of the compiled plain.
    adaptive/plain is reported; its bar is ``never_loses``'."""
    if (reason := cs.unusable(check, quantization)) is not None:
        return {"passed": None, "fallback": True, "summary": reason}
    tgt, drf = check.model(TARGET, quantization), check.model(DRAFT, quantization, head=True)
    given = _profile_given(check, quantization)
    plain = check.spec(speculation="fixed", num_speculative_tokens=0, **given)
    methods = {
        "hf-plain": {},
        "plain": plain,
        "plain-again": plain,
        "fixed-k4": check.spec(speculation="fixed", num_speculative_tokens=4, assistant_model=drf, **given),
        "adaptive": check.spec(speculation="adaptive", assistant_model=drf, **given),
        "adaptive-lookup": check.spec(speculation="adaptive", **given),
        "fixed-self": check.spec(speculation="fixed", num_speculative_tokens=4, assistant_model=tgt),
        "adaptive-self": check.spec(speculation="adaptive", assistant_model=tgt),
    }
    new, prompts = 12 if check.tiny else 64, cs.speed_prompts(tgt.config.vocab_size, SPEED_PROMPT)
    out: dict = {"quantization": quantization, "cost_source": "profile" if given else "calibrated"}
    if quantization == "none":
        methods["hf-compiled"] = {"cache_implementation": "static"}
        start = time.perf_counter()
        cs.generate(tgt, prompts[0], new, methods["hf-compiled"])  # transformers compiles the decoding forward
        out["hf_compiled_first_call_s"] = round(time.perf_counter() - start, 1)
    tps = timing.timed_runs(tgt, methods, prompts, new, 1 if check.tiny else 2)
    out["recordings"] = {role: timing.recordings(model) for role, model in (("target", tgt), ("draft", drf))}
    ratio = {
        f"{a}/{b}": round(tps[a] / tps[b], 3)
        for a, b in (
            ("plain-again", "plain"),
            ("adaptive", "plain"),
            ("adaptive", "hf-plain"),
            ("adaptive", "hf-compiled"),
            ("plain", "hf-compiled"),
            ("adaptive-self", "fixed-self"),
            ("adaptive-lookup", "plain"),
            ("fixed-k4", "plain"),
        )
        if b in tps
    }
    bars = {"self_draft": ratio["adaptive-self/fixed-self"] >= WIN_MARGIN}
    if "adaptive/hf-compiled" in ratio:
        bars["vs_compiled"] = ratio["adaptive/hf-compiled"] >= COMPILED_MARGIN
    line = (
        f"{label(quantization)} tokens/s: "
        + ", ".join(f"{m} {v}" for m, v in tps.items())
        + "; "
        + ", ".join(f"{k} {v}" for k, v in ratio.items())
        + "; recordings (first use, ms): "
        + ", ".join(f"{role} {r['widths']} {r['capture_ms']}" for role, r in out["recordings"].items())
        + ("; not judged (--tiny)" if check.tiny else "")
    )
    return {
        **out,
        "passed": None if check.tiny else all(bars.values()),
        "tokens_per_s": tps,
        "ratios": ratio,
        "bars": bars,
        "summary": line,
    }


def speedup(base: list[float], mine: list[float]) -> float:
    """One round's tokens/s ratio of a method over the base: the geometric mean over prompts of base seconds
    over the method's (``base``, ``mine``: seconds per prompt), 3 decimals."""
    return round(math.exp(statistics.fmean(math.log(b / m) for b, m in zip(base, mine, strict=True))), 3)


def never_loses(check: Check, quantization: str) -> dict:
    """The never-loses bar: ``adaptive`` with the random-weight draft (acceptance ≈ 0, so every step it decides
    should be plain) at least ``WIN_MARGIN`` of hf-adaspec's plain (``fixed`` k = 0) in tokens/s, with plain
    timed twice (the A/A). Batch 1, greedy, 64 tokens, 6 prompts of ``SPEED_PROMPT`` tokens (``speed``'s three
    kinds, two seeds), ``NEVER_LOSES_ROUNDS`` timed rounds interleaved per request (``timed_seconds``); the
    figures are ``tokens_per_s``'s (per prompt the median over rounds). Also each round's ratios (geometric mean
    over the prompts) and how adaptive spent one request's steps (``drafter_use``). Not judged with --tiny."""
    if (reason := cs.unusable(check, quantization)) is not None:
        return {"passed": None, "fallback": True, "summary": reason}
    tgt, drf = check.model(TARGET, quantization), check.model(DRAFT, quantization, head=True)
    given = _profile_given(check, quantization)
    plain = check.spec(speculation="fixed", num_speculative_tokens=0, **given)
    methods = {
        "plain": plain,
        "plain-again": plain,
        "adaptive": check.spec(speculation="adaptive", assistant_model=drf, **given),
    }
    vocab, new = tgt.config.vocab_size, 12 if check.tiny else 64
    prompts = cs.speed_prompts(vocab, SPEED_PROMPT, seed=7) + cs.speed_prompts(vocab, SPEED_PROMPT, seed=8)
    seconds = timing.timed_seconds(tgt, methods, prompts, new, 1 if check.tiny else NEVER_LOSES_ROUNDS)
    tps = {m: round(timing.tokens_per_s(seconds[m], new), 2) for m in methods}
    ratio = {f"{m}/plain": round(tps[m] / tps["plain"], 3) for m in ("plain-again", "adaptive")}
    rounds = {
        f"{m}/plain": [speedup(base, mine) for base, mine in zip(seconds["plain"], seconds[m], strict=True)]
        for m in ("plain-again", "adaptive")
    }
    used = cs.drafter_use(tgt, prompts[0], new, methods["adaptive"])
    bars = {"never_loses": ratio["adaptive/plain"] >= WIN_MARGIN}
    line = (
        f"{label(quantization)} tokens/s ({len(prompts)} prompts × {len(seconds['plain'])} rounds): "
        + ", ".join(f"{m} {v}" for m, v in tps.items())
        + "; "
        + ", ".join(f"{k} {v}" for k, v in ratio.items())
        + "; per round: "
        + ", ".join(f"{k} {v}" for k, v in rounds.items())
        + "; adaptive's steps (accepted/drafted): "
        + ", ".join(f"{d} {n} ({used['accepted'][d]}/{used['drafted'][d]})" for d, n in used["steps"].items())
        + ("; not judged (--tiny)" if check.tiny else "")
    )
    return {
        "passed": None if check.tiny else bars["never_loses"],
        "quantization": quantization,
        "cost_source": "profile" if given else "calibrated",
        "tokens_per_s": tps,
        "ratios": ratio,
        "per_round": rounds,
        "bars": bars,
        "adaptive_random_draft_steps": used,
        "summary": line,
    }


def engine_time(check: Check, q: str) -> dict:
    """The engine's own ms per step at batch 1 (wall less every forward, forwards timed with the device
    synchronised) against the target's mean forward, and transformers' own ms per token for plain; the median
    over the speculative runs and hf-adaspec's plain become the replay's overheads (a decided step's and a plain
    one's: ``adaptive`` runs with rest=False here, deciding every step)."""
    if (reason := cs.unusable(check, q)) is not None:
        return {"passed": None, "fallback": True, "summary": reason}
    tgt, drf = check.model(TARGET, q), check.model(DRAFT, q, head=True)
    prompt, new = cs.check_prompts(tgt.config.vocab_size, seed=6)[0], 12 if check.tiny else 128
    runs = {
        "adaptive": check.spec(speculation="adaptive", assistant_model=drf, rest=False),
        "adaptive-lookup": check.spec(speculation="adaptive", rest=False),
        "fixed-k4": check.spec(speculation="fixed", num_speculative_tokens=4, assistant_model=drf),
        "plain": check.spec(speculation="fixed", num_speculative_tokens=0),
        "hf-plain": {},
    }
    with timing.forward_timer((tgt, drf)) as timer:
        out = {name: timing.engine_overhead(tgt, timer, prompt, new, kwargs) for name, kwargs in runs.items()}
    spec = statistics.median(v["engine_ms_per_step"] for k, v in out.items() if "plain" not in k)
    check.facts["overheads"] = (spec, out["plain"]["engine_ms_per_step"])
    a = out["adaptive"]
    share = a["engine_ms_per_step"] / a["target_ms_per_forward"]
    return {
        "passed": None,
        "quantization": q,
        "runs": out,
        "over_10pct": share > 0.10,
        "overheads_ms": check.facts["overheads"],
        "summary": f"{label(q)} adaptive: engine {a['engine_ms_per_step']} ms/step = {share:.1%} of the "
        f"target's {a['target_ms_per_forward']} ms forward; plain: hf-adaspec "
        f"{out['plain']['engine_ms_per_step']} ms/step, transformers "
        f"{out['hf-plain']['engine_ms_per_step']} ms/token",
    }
