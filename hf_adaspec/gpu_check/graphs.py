"""The GPU check's steps about recorded forwards (``backend.static_kv``, ``backend.head_kv``): a replayed
CUDA graph against the eager forward of the dynamic cache on the same tokens, with what each width's recording
cost; an EAGLE-3 head's drafted column replayed against its eager step; and whether the draft's 1-token step
recorded after ``torch.compile`` beats the plain recording (the faster is kept for the rest of the check); and
that a capture made to fail (a synchronisation inside it, as the check's own clock did on 2026-11-28) fails no
request and leaves nothing behind (``capture_recovery``)."""

from __future__ import annotations

import statistics
import time

import torch

from ..backend import arena_sizes
from ..backend import graphs as recorded
from ..backend.arenas import arenas_of
from ..backend.caches import open_cache, open_head_cache
from ..costs.table import ForwardProbe, HeadProbe
from ..models.eagle3_format import random_head
from . import steps as cs
from .steps import BIG, DRAFT, NEAR_TIE, TARGET, Check

PROMPT, WIDTHS = 24, (1, 4, 9)  # on a GPU width 4 runs padded to 5 (arena_sizes.run_width)


@torch.no_grad()
def graphs(check: Check) -> dict:
    """The bf16 target after a ``PROMPT``-token prompt: per width n in ``WIDTHS`` the logits of the arena's
    replay (second use; the first records) against the dynamic cache's eager forward over the same n tokens:
    largest difference over the logits' spread, and the positions whose argmax differs away from a near-tie
    (top-2 gap > ``NEAR_TIE``; must be none); and every recording's capture, eager and replay ms."""
    tgt = check.model(TARGET, "none")
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(1, tgt.config.vocab_size, (1, PROMPT + max(WIDTHS)), generator=gen)
    dynamic = open_cache(tgt, 1)
    arena = open_cache(tgt, 1, check.kv_cache, arena_sizes.capacity_for(PROMPT), "check", max(WIDTHS))
    for cache in (dynamic, arena):
        cache.append(ids[:, :PROMPT], torch.ones(1, PROMPT, dtype=torch.bool), 1)
    held, rows = torch.tensor([PROMPT]), {}
    for n in WIDTHS:
        block, valid = ids[:, PROMPT : PROMPT + n], torch.ones(1, n, dtype=torch.bool)
        arena.append(block, valid, n)  # records width n
        arena.rollback(held)
        got, want = arena.append(block, valid, n)[0], dynamic.append(block, valid, n)[0]  # [n, V]
        for cache in (dynamic, arena):
            cache.rollback(held)
        top2 = want.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > NEAR_TIE
        rows[f"n{n}"] = {
            "max_diff_over_std": round(float((got - want).abs().max() / want.std()), 4),
            "argmax_differs_clear": int(((got.argmax(-1) != want.argmax(-1)) & clear).sum()),
        }
    records = [r.__dict__ for r in arenas_of(tgt).records()]
    passed = all(r["argmax_differs_clear"] == 0 for r in rows.values())
    kept = [r for r in records if r["kept"]]
    line = (
        "replay vs eager: "
        + ", ".join(f"{k} diff/std {v['max_diff_over_std']}" for k, v in rows.items())
        + f"; {len(kept)}/{len(records)} recordings kept, replay "
        + ", ".join(
            f"n{r['width']} {r['replay_ms']} ms (eager {r['eager_ms']}, capture {r['capture_ms']})" for r in records
        )
    )
    return {"passed": passed, "widths": rows, "records": records, "summary": line}


@torch.no_grad()
def head_graphs(check: Check, repeats: int = 20, columns: int = 8) -> dict:
    """A random-weight EAGLE-3 head for the bf16 target (``random_head``): its drafted column at batch 1 and
    context 512 (``HeadProbe``, median of ``repeats`` after one untimed call, which records) with its entries
    in a ``HeadCache`` (eager) and in its arena (replayed), and what recording took; then ``columns`` drafted
    columns from the same 32 entries in both, greedily: the arena's argmax must not differ from the eager
    one away from a near-tie (top-2 gap > ``NEAR_TIE``)."""
    head = random_head(check.model(TARGET, "none"), seed=5)
    ms = {}
    for kind in ("dynamic", "static"):
        probe = HeadProbe(head, 512, 1, kind)
        probe.time_ms(1)
        ms[kind] = round(statistics.median(probe.time_ms(1) for _ in range(repeats)), 3)
    gen, width = torch.Generator().manual_seed(6), 3 * head.config.target_hidden_size
    tokens = torch.randint(1, head.config.target_vocab_size, (1, 32), generator=gen)
    features = head.fuse(torch.randn(1, 32, width, generator=gen))
    caches = (open_head_cache(head, 1), open_head_cache(head, 1, "static"))
    hidden = [head.step(tokens, features, torch.ones(1, 32, dtype=torch.bool), c)[:, -1:] for c in caches]
    token, differs = tokens[:, -1:], 0
    for _ in range(columns):
        (eager, want), (replayed, got) = (c.draft_column(head, token, h) for c, h in zip(caches, hidden))
        top2 = want.topk(2, dim=-1).values
        differs += int(((want.argmax(-1) != got.argmax(-1)) & ((top2[:, 0] - top2[:, 1]) > NEAR_TIE)).sum())
        token, hidden = want.argmax(-1, keepdim=True), [eager, replayed]
    capture = [r.capture_ms for r in arenas_of(head).records()]
    return {
        "passed": differs == 0,
        "eager_ms": ms["dynamic"],
        "replayed_ms": ms["static"],
        "capture_ms": capture,
        "argmax_differs_clear": differs,
        "summary": f"EAGLE-3 head's drafted column at context 512: eager {ms['dynamic']} ms, replayed "
        f"{ms['static']} ms (recording {capture} ms); {differs} of {columns} greedy columns differ "
        "away from a near-tie",
    }


def compile_draft(check: Check, repeats: int = 20) -> dict:
    """The bf16 draft's 1-token step at batch 1 and context 512 (``ForwardProbe``, median of ``repeats``):
    recorded as is, then recorded after ``torch.compile`` (its first use compiles: timed apart). The rest of
    the check records plainly (a compiled step recompiles for new arena sizes: minutes)."""
    if check.tiny:
        return {
            "passed": None,
            "summary": "not measured with --tiny (compiling takes a minute on a CPU; "
            "tests/test_static_kv.py compiles a recording there)",
        }
    drf, context = check.model(DRAFT, "none", head=True), 512

    def median_ms() -> tuple[float, float]:
        arenas_of(drf).drop()
        start = time.perf_counter()
        probe = ForwardProbe(drf, context, 1, 1, check.kv_cache, prefill=False)
        probe.time_ms(1, keep=1)  # records (and compiles) width 1
        first = time.perf_counter() - start
        return statistics.median(probe.time_ms(1, keep=1) for _ in range(repeats)), first

    plain_ms, _ = median_ms()
    arenas_of(drf).compile(frozenset({1}))
    try:
        compiled_ms, first_s = median_ms()
        records = [r.__dict__ for r in arenas_of(drf).records()]
    finally:
        arenas_of(drf).compile(frozenset())
    big = check.facts.get(f"verify_ms_n1 {BIG} none")  # the 7B's 1-token step from its profile, if measured
    versus = (
        (
            f"; of the 7B target's 1-token step ({big:.3f} ms): {plain_ms / big:.2f} recorded, "
            f"{compiled_ms / big:.2f} compiled"
        )
        if big
        else ""
    )
    return {
        "passed": None,
        "recorded_ms": round(plain_ms, 3),
        "compiled_recorded_ms": round(compiled_ms, 3),
        "compile_first_use_s": round(first_s, 1),
        "records": records,
        "target_7b_n1_ms": big,
        "summary": f"draft token at batch 1, context {context}: recorded {plain_ms:.3f} ms, recorded after "
        f"torch.compile {compiled_ms:.3f} ms (first use, compiling, {first_s:.1f} s){versus}",
    }


@torch.no_grad()
def capture_recovery(check: Check, new: int = 16) -> dict:
    """A request whose target synchronises inside every capture (a forward pre-hook, as the check's clock did on
    2026-11-28): it completes, each of its widths recorded as failed (they run eagerly); then, the hook removed and
    the model's arenas dropped, the same request records every width, and a random draw outside captures works
    (the failed captures' pool and generator state were released). On a CPU nothing synchronises: it passes."""
    tgt = check.model(TARGET, "none")
    prompt = cs.check_prompts(tgt.config.vocab_size, seed=9)[0]
    kwargs = check.spec(speculation="adaptive", rest=False, speculation_costs=cs.COSTS)  # no calibration under the hook
    clock = tgt.register_forward_pre_hook(
        lambda module, args: torch.cuda.synchronize() if tgt.device.type == "cuda" else None
    )
    arenas_of(tgt).drop()
    try:
        hooked = cs.generate(tgt, prompt, new, kwargs)
        failed = [r.error for r in arenas_of(tgt).records() if r.error is not None]
    finally:
        clock.remove()
        arenas_of(tgt).drop()
        recorded.forget_failures(tgt)
    again = cs.generate(tgt, prompt, new, kwargs)
    records = arenas_of(tgt).records()
    torch.randn(4, device=tgt.device)
    cuda = tgt.device.type == "cuda"
    passed = (
        hooked.sequences.shape == again.sequences.shape
        and all(r.error is None for r in records)
        and (bool(failed) or not cuda)
    )
    return {
        "passed": passed,
        "failed_captures": len(failed),
        "first_error": failed[0] if failed else None,
        "recorded_after": len(records),
        "same_tokens": torch.equal(hooked.sequences, again.sequences),
        "summary": f"{len(failed)} captures failed under a synchronising hook (request completed, eager); "
        f"then {len(records)} recorded cleanly" + ("" if cuda else " (a CPU: nothing synchronises)"),
    }
