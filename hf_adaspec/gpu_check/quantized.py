"""The GPU check's steps about 4-bit targets: which 4-bit format the 7B runs in, and what its steps cost (with
bitsandbytes' NF4 an H200 verified 5 tokens of the 7B in 14.3 ms against 7.3 for 1; bf16: 8.6 and 7.4).

``formats_7b`` is ``quantization="auto"``'s probe (``models.format_choice``) on the 7B with random weights: every
format ``auto`` tries on this device (``formats.probed_for``; one whose kernel is missing is recorded with the
line naming it) is loaded, timed over 1 and k + 1 tokens (``forward_ms``, medians) and scored by the quality
measure the CPU uses (top-1 agreement with the bf16 model's greedy tokens, teacher-forced; here on random
prompts, since random weights have no tokenizer). ``pick`` over the 4-bit formats (NF4 kept unless another
scores ``SWITCH_MARGIN`` below it) gives the 7B's 4-bit format; ``pick`` over all, what ``auto`` would load.
``profile_7b_4bit`` profiles the 7B in that format with the bf16 0.5B draft recorded after ``torch.compile``
(batch 1) and judges two bars on its recorded steps at context 512: a verification over 5 tokens at
most ``VERIFY_RATIO`` of a 1-token step, and that step no slower than bf16's (``profile-7b-bf16``, this run).
"""

from __future__ import annotations

import gc
from pathlib import Path

import torch

from ..models import format_choice as fc
from ..models import format_rules as fr
from ..models.format_quality import greedy_reference
from ..models.formats import probed_for
from .profiles import FOUR_BIT_PROFILE, profile_pair
from .steps import BIG, Check, check_prompts, unusable

VERIFY_RATIO = 1.3  # the bar: t_verify(5) / t_verify(1)
QUALITY_NEW = 32  # bf16 greedy tokens per prompt in the quality reference (--tiny: 8)
FOUR_BIT = "format 7b"  # check.facts: the 7B's 4-bit format (formats-7b, or read back from the results)


def formats_7b(check: Check) -> dict:
    """The 7B's weight formats on this device, timed and scored as ``auto`` does (module docstring); the chosen
    4-bit format goes to ``check.facts[FOUR_BIT]``. Passes when a 4-bit format loaded."""
    check.drop()
    dense = check.model(BIG, "none")
    prompts = [torch.tensor(p) for p in check_prompts(dense.config.vocab_size, seed=9)]
    refs = greedy_reference(dense, prompts, 8 if check.tiny else QUALITY_NEW)
    measures = [fc.measure_format("none", lambda: dense, fc.forward_ms, refs, None)[0]]
    dense = None  # the loader above reads the name: the dense 7B is freed before the 4-bit formats load
    for fmt in sorted((f for f in probed_for(check.device) if f != "none"), key=lambda f: f != "nf4"):
        check.drop()  # one 7B in memory at a time
        gc.collect()
        if (reason := unusable(check, fmt)) is not None:
            measures.append(fc.FormatMeasure(fmt, error=reason))
            continue
        best = min((fc.score(m.ms_1, m.ms_k) for m in measures if m.ms_1 is not None), default=None)
        measures.append(fc.measure_format(fmt, lambda f=fmt: check.model(BIG, f), fc.forward_ms, refs, best)[0])
    check.drop()
    four_bit = tuple(m for m in measures if m.format != "none")
    loaded = [m for m in four_bit if m.error is None]
    chosen = fr.pick(four_bit) if loaded else None
    overall = fr.pick(tuple(measures))
    if chosen is not None:
        check.facts[FOUR_BIT] = chosen
    rows = [
        {
            **m.__dict__,
            "score": round(fc.score(m.ms_1, m.ms_k), 3) if m.ms_1 is not None else None,
            "verify_over_step": round(m.ms_k / m.ms_1, 3) if m.ms_1 else None,
        }
        for m in measures
    ]
    return {
        "passed": chosen is not None,
        "chosen_4bit": chosen,
        "auto_would_load": overall,
        "measures": rows,
        "summary": f"the 7B's 4-bit format: {chosen}; auto would load {overall}; 1/{fc.PROBE_K + 1}-token "
        f"forwards at context {fc.PROBE_CONTEXT}: " + "; ".join(m.text(2) for m in measures),
    }


def profile_7b_4bit(check: Check) -> dict:
    """The 7B's profile in its 4-bit format (``formats_7b``) with the bf16 0.5B draft recorded after
    ``torch.compile``, batch 1; bars at batch 1, context 512: t_verify(5) / t_verify(1) ≤ ``VERIFY_RATIO`` and
    t_verify(1) ≤ bf16's (from ``profile-7b-bf16`` in this run or its results; not judged without it or with
    --tiny)."""
    fmt = check.facts.get(FOUR_BIT)
    if fmt is None:
        raise RuntimeError("no 4-bit format chosen: run the formats-7b step first (in this run or its results)")
    entry = profile_pair(check, BIG, fmt, compiled_draft=True, draft_quantization="none")
    if entry.get("fallback"):
        return entry
    check.facts[FOUR_BIT_PROFILE] = Path(entry["path"]).parent.name
    b1 = entry["costs"]["b1"]
    ratio = b1["verify_ms_n5"] / b1["verify_ms_n1"]
    bf16 = check.facts.get(f"verify_ms_n1 {BIG} none")
    bars = {"verify_5_over_1": ratio <= VERIFY_RATIO}
    if bf16 is not None:
        bars["step_vs_bf16"] = b1["verify_ms_n1"] <= bf16
    judged = not check.tiny and "step_vs_bf16" in bars
    versus = f", bf16's 1-token step {bf16:.3f} ms" if bf16 is not None else ", bf16's step not measured in this run"
    return {
        **entry,
        "format": fmt,
        "verify_5_over_1": round(ratio, 3),
        "bf16_verify_ms_n1": bf16,
        "bars": bars,
        "passed": all(bars.values()) if judged else None,
        "summary": f"{entry['summary']}; t_verify(5)/t_verify(1) {ratio:.3f} (bar {VERIFY_RATIO}){versus}"
        + ("" if judged else "; not judged"),
    }
