"""Does a draft head restricted to the N most frequent tokens pay (FR-Spec, arXiv 2502.14856; issue 26 item 2)?

Lossless (verification is exact); the cost is that a draft token outside the top-N set can never be proposed.
1. Frequencies, offline: the draft's tokenizer over this interpreter's standard-library sources (CPython,
   PSF License; every .py under sysconfig's stdlib but test/ and site-packages) plus the Spec-Bench
   prompts of the tune split (even ids, all turns): ranking "stdlib+spec_bench_tune"; "+tune_outputs"
   mixes in the target's outputs of the tune traces (equal weight of the two normalised counts). By
   count, ties by id; the EOS ids always lead (a head without EOS could never end a proposal).
2. Cost: the whole draft's 1-token forward (``hf_compat.forward_logits``) on synthetic 128- and 512-token
   caches per head: the loaded NF4 head (full), a dense bf16 copy, and per N the top-N rows of the
   dequantized head as bf16 ``nn.Linear`` and NF4 ``Linear4bit``, its logits scattered into a -inf
   [.., 151936] tensor (timed). All heads interleaved (order rotated per round), median and 10th
   percentile of --repeats after --warmup, torch's default threads, after up to --wait-quiet s for a
   1-min load average < 1; ratio_to_full: median over rounds of a head's time / the full head's.
3. Agreement per split (tune / held-out Spec-Bench, held-out code): draft_next[j] == tokens[p + j],
   j = 1..n-1 (``Trace.draft_agreement``); kept: that token is in the top N; gain_bound: the draft's
   argmax outside, the target's token inside the set (the restricted draft might agree; ignored below).
   "+tune_outputs" tune figures are in-sample.
4. Replay prediction (``replay_all``, the repository's profile): adaptive vs plain on held-out Spec-Bench
   and code, draft_next set to -1 (never matches) where the draft agreed on a token outside the top N
   (q kept), the profile's draft 1-token cost × ratio_to_full (linear between the contexts; catch-up
   unchanged). Timings are indicative: the 2-core CPU is shared.

Run: python benchmarks/draft_head_vocab.py [--repeats 41] [--warmup 3] [--wait-quiet 300]
Writes benchmarks/results/draft_head_vocab.json; last stdout line: one JSON object.
"""

import argparse
import dataclasses
import json
import math
import os
import statistics
import sysconfig
import time
from pathlib import Path

import bitsandbytes as bnb
import torch

import hf_adaspec
from hf_adaspec.costs.profile import Profile, load_profile
from hf_adaspec.files import atomic_write
from hf_adaspec.backend import hf_compat
from hf_adaspec.tools.bench import split_of
from hf_adaspec.tools.replay import Clock
from hf_adaspec.tools.replay_report import replay_all
from hf_adaspec.tools.trace import Trace, load_traces

VOCAB = 151936
SIZES = (65536, 32768, 16384, 8192)
CONTEXTS = (128, 512)
PROFILE = "model_cards/qwen2.5-coder-1.5b_0.5b/profile.json"
OUTPUT = Path("benchmarks/results/draft_head_vocab.json")
SPEC_BENCH = (Path("../shared/data/spec_bench/question.jsonl"), Path("/work/shared/data/spec_bench/question.jsonl"))
SENTINEL = -1  # a draft id no target token equals


def stdlib_texts(cap: int) -> list[str]:
    """The .py sources under this interpreter's stdlib (test/ and site-packages left out), in path order,
    up to ``cap`` characters."""
    root, texts, total = Path(sysconfig.get_paths()["stdlib"]), [], 0
    for folder, dirs, files in os.walk(root):  # top-down; sorting dirs in place fixes the order
        dirs[:] = sorted(d for d in dirs if d not in ("test", "site-packages", "__pycache__"))
        for name in sorted(f for f in files if f.endswith(".py")):
            if total < cap:
                texts.append((Path(folder) / name).read_text(encoding="utf-8", errors="replace"))
                total += len(texts[-1])
    return texts


def counts_of(ids: list[list[int]]) -> torch.Tensor:
    """[VOCAB] float64 counts of the ids in ``ids``."""
    flat = torch.tensor([i for seq in ids for i in seq], dtype=torch.long)
    return torch.bincount(flat, minlength=VOCAB)[:VOCAB].double()


def rankings(tokenizer, traces: list[Trace], cap: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Token ids ranked by frequency per source variant (EOS first, then count, ties by id), and what
    was counted."""
    path = next(p for p in SPEC_BENCH if p.is_file())
    questions = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    turns = [t for q in questions if split_of(q["question_id"]) == "tune" for t in q["turns"]]
    code = stdlib_texts(cap)
    enc = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]
    base = counts_of(enc(code)) + counts_of(enc(turns))
    outputs = counts_of([list(t.tokens[t.prompt_len :]) for t in traces if t.split == "tune"])
    eos = sorted({e for t in traces for e in t.eos})
    variants = {"stdlib+spec_bench_tune": base, "+tune_outputs": base / base.sum() + outputs / outputs.sum()}
    out = {name: torch.argsort(-c.index_fill(0, torch.tensor(eos), math.inf), stable=True) for name, c in variants.items()}
    info = {"stdlib_files": len(code), "stdlib_chars": sum(map(len, code)), "spec_bench": str(path),
            "spec_bench_tune_turns": len(turns), "base_tokens": int(base.sum()),
            "tune_output_tokens": int(outputs.sum()), "distinct_base": int((base > 0).sum()), "eos_ids": eos}
    return out, info


class RestrictedHead(torch.nn.Module):
    """A head over ``ids`` ([N] long) whose logits land in a full-vocabulary tensor filled with -inf."""

    def __init__(self, linear: torch.nn.Module, ids: torch.Tensor) -> None:
        super().__init__()
        self.linear, self.ids = linear, ids

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [.., H] → [.., VOCAB]
        small = self.linear(hidden)
        return small.new_full((*small.shape[:-1], VOCAB), -math.inf).index_copy_(-1, self.ids, small)


def nf4_linear(weight: torch.Tensor, like) -> torch.nn.Module:
    """An NF4 ``Linear4bit`` of ``weight`` [N, H] (quantized as the loaded head: its block size and
    nested statistics)."""
    packed, state = bnb.functional.quantize_4bit(weight, blocksize=like.blocksize, quant_type="nf4",
                                                 compress_statistics=like.nested)
    layer = bnb.nn.Linear4bit(weight.shape[1], weight.shape[0], bias=False, compute_dtype=weight.dtype,
                              quant_type="nf4", device="cpu")
    layer.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, quant_type="nf4",
                                     blocksize=like.blocksize, bnb_quantized=True, module=layer)
    return layer.eval()


def build_heads(model, order: torch.Tensor) -> dict[str, torch.nn.Module]:
    """"nf4-151936" (the loaded head), "bf16-151936" and per N "bf16-N" / "nf4-N" restricted heads."""
    full = model.lm_head
    dense = bnb.functional.dequantize_4bit(full.weight.data, full.weight.quant_state).to(torch.bfloat16)  # [V, H]
    heads = {f"nf4-{VOCAB}": full}
    heads[f"bf16-{VOCAB}"] = torch.nn.Linear(dense.shape[1], VOCAB, bias=False, dtype=torch.bfloat16)
    heads[f"bf16-{VOCAB}"].weight.data = dense
    for n in SIZES:
        ids = order[:n].sort().values  # ascending rows read the weight in order
        lin = torch.nn.Linear(dense.shape[1], n, bias=False, dtype=torch.bfloat16)
        lin.weight.data = dense[ids].contiguous()
        heads[f"bf16-{n}"] = RestrictedHead(lin, ids)
        heads[f"nf4-{n}"] = RestrictedHead(nf4_linear(dense[ids].contiguous(), full.weight.quant_state), ids)
    return heads


@torch.no_grad()
def check_heads(model, heads: dict, trace: Trace) -> dict[str, float]:
    """Per restricted head: share of positions along one trace where its argmax equals the full head's,
    among those whose full argmax is in its set (should be ~1)."""
    seq, out = torch.tensor([trace.tokens[:256]]), {}
    ref = hf_compat.forward_logits(model, seq, hf_compat.new_cache(model), keep=seq.shape[1])[0].argmax(-1)
    for name, head in heads.items():
        if isinstance(head, RestrictedHead):
            model.lm_head = head
            got = hf_compat.forward_logits(model, seq, hf_compat.new_cache(model), keep=seq.shape[1])[0].argmax(-1)
            inside = torch.isin(ref, head.ids)
            out[name] = round(float((got == ref)[inside].float().mean()), 4)
    model.lm_head = heads[f"nf4-{VOCAB}"]
    return out


def wait_quiet(limit_s: float) -> float:
    """Wait (at most ``limit_s``) until the 1-minute load average drops below 1; returns it."""
    end = time.monotonic() + limit_s
    while (load := os.getloadavg()[0]) >= 1.0 and time.monotonic() < end:
        time.sleep(10)
    return load


@torch.no_grad()
def time_heads(model, heads: dict, repeats: int, warmup: int) -> dict:
    """Per context and head: median and 10th-percentile ms of the draft's 1-token forward, and the median
    over rounds of its ratio to the full NF4 head's time in the same round (robust to drift); all heads
    interleaved, their order rotated per round."""
    caches = {c: hf_compat.synthetic_cache(model, 1, c) for c in CONTEXTS}
    token, names, full = torch.tensor([[13]]), list(heads), f"nf4-{VOCAB}"
    samples = {(c, n): [] for c in CONTEXTS for n in names}
    for r in range(warmup + repeats):
        turn = names[r % len(names):] + names[: r % len(names)]
        for c in CONTEXTS:
            for name in turn:
                model.lm_head = heads[name]
                start = time.perf_counter()
                hf_compat.forward_logits(model, token, caches[c], keep=1)
                if r >= warmup:
                    samples[(c, name)].append((time.perf_counter() - start) * 1000.0)
                hf_compat.rollback(caches[c], c)
    model.lm_head = heads[full]
    q10 = lambda xs: sorted(xs)[len(xs) // 10]
    ratio = lambda c, n: statistics.median(a / b for a, b in zip(samples[(c, n)], samples[(c, full)]))
    return {stat: {c: {n: round(f(c, n), 3 if stat == "ratio_to_full" else 2) for n in names} for c in CONTEXTS}
            for stat, f in (("median_ms", lambda c, n: statistics.median(samples[(c, n)])),
                            ("p10_ms", lambda c, n: q10(samples[(c, n)])), ("ratio_to_full", ratio))}


def split_sets(traces: list[Trace]) -> dict[str, list[Trace]]:
    return {"tune": [t for t in traces if t.split == "tune" and t.source == "spec_bench"],
            "held-out": [t for t in traces if t.split == "held-out" and t.source == "spec_bench"],
            "code": [t for t in traces if t.split == "held-out" and t.source == "code"]}


def agreement(traces: list[Trace], order: torch.Tensor) -> dict:
    """Agreement of the draft's argmax with the target's token (j = 1..n-1), and what the top N keep."""
    pairs = [(d, t) for tr in traces for d, t in zip(tr.draft_next[1 : tr.new_tokens], tr.tokens[tr.prompt_len + 1 :])]
    d, t = torch.tensor(pairs).T
    rank = torch.empty(VOCAB, dtype=torch.long)
    rank[order] = torch.arange(VOCAB)
    share = lambda mask: round(float(mask.float().mean()), 4)
    return {"positions": len(pairs), "agree": share(d == t), **{key: {n: share(f(n)) for n in SIZES} for key, f in (
        ("kept", lambda n: (d == t) & (rank[t] < n)), ("target_in_set", lambda n: rank[t] < n),
        ("gain_bound", lambda n: (rank[d] >= n) & (rank[t] < n)))}}


def restricted(trace: Trace, top: set[int]) -> Trace:
    """``trace`` with draft_next[j] = SENTINEL where the draft agreed on a target token outside ``top``."""
    nxt = list(trace.draft_next)
    for j in range(1, trace.new_tokens):
        if nxt[j] == trace.tokens[trace.prompt_len + j] and nxt[j] not in top:
            nxt[j] = SENTINEL
    return dataclasses.replace(trace, draft_next=tuple(nxt))


class ScaledDraft(Profile):
    """A profile whose draft 1-token cost is scaled by ``ratio(context)``."""

    def draft_ms(self, batch: int, context: int, forced: str | None = None) -> float:
        return super().draft_ms(batch, context, forced) * self.ratio(context)


def scaled(profile: Profile, ratios: tuple[float, float]) -> Profile:
    """``profile`` with draft costs × ratios at CONTEXTS, linear between, flat outside."""
    out = ScaledDraft(**{f.name: getattr(profile, f.name) for f in dataclasses.fields(Profile)})
    (c0, c1), (r0, r1) = CONTEXTS, ratios
    object.__setattr__(out, "ratio", lambda c: r0 + (r1 - r0) * min(1.0, max(0.0, (c - c0) / (c1 - c0))))
    return out


def speedup(traces: list[Trace], profile: Profile) -> float:
    """Geometric mean over prompts of adaptive's predicted tokens/s over plain's."""
    result = replay_all(traces, ["plain", "adaptive"], Clock(profile))
    assert all(r.matches_trace for r in result.replays), "replay output differs from the traces"
    runs = result.runs
    plain = {r.question_id: r.tokens_per_s for r in runs if r.method == "plain"}
    ratios = [r.tokens_per_s / plain[r.question_id] for r in runs if r.method == "adaptive"]
    return round(math.exp(statistics.fmean(math.log(x) for x in ratios)), 4)


def replays(sets: dict, orders: dict, ms: dict) -> dict:
    """Predicted adaptive speedup per ranking, head kind, N and split (full head: the traces as taken)."""
    profile = load_profile(PROFILE)
    out = {"full": {s: speedup(sets[s], profile) for s in ("held-out", "code")}}
    for rank_name, order in orders.items():
        for n in SIZES:
            top = set(order[:n].tolist())
            cut = {s: [restricted(t, top) for t in sets[s]] for s in ("held-out", "code")}
            for kind in ("bf16", "nf4"):
                ratios = tuple(ms["ratio_to_full"][c][f"{kind}-{n}"] for c in CONTEXTS)
                out[f"{rank_name}/{kind}-{n}"] = {"draft_cost_ratio": [round(r, 3) for r in ratios], **{
                    s: speedup(cut[s], scaled(profile, ratios)) for s in cut}}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--wait-quiet", type=float, default=300.0, help="seconds to wait for load < 1 before timing")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-chars", type=int, default=30_000_000)
    args = ap.parse_args()
    traces = load_traces(Path("benchmarks/traces"))
    draft = hf_adaspec.load("qwen2.5-coder-0.5b", quantize_lm_head=True)
    orders, sources = rankings(draft.tokenizer, traces, args.max_chars)
    print("sources", json.dumps(sources), flush=True)
    sets = split_sets(traces)
    agree = {name: {s: agreement(ts, order) for s, ts in sets.items()} for name, order in orders.items()}
    print("agreement", json.dumps(agree), flush=True)
    heads = build_heads(draft.model, orders["stdlib+spec_bench_tune"])
    checks = check_heads(draft.model, heads, sets["tune"][0])
    load = [wait_quiet(args.wait_quiet), None]
    ms = time_heads(draft.model, heads, args.repeats, args.warmup)
    load[1] = os.getloadavg()[0]
    print("ms_per_draft_token", json.dumps(ms), "argmax_checks", json.dumps(checks), flush=True)
    predicted = replays(sets, orders, ms)
    best = max((k for k in predicted if k != "full"), key=lambda k: predicted[k]["held-out"])
    result = {"best_restricted_held_out": {"variant": best, **predicted[best]}, "full_head": predicted["full"],
              "sources": sources, "ms_per_draft_token": ms, "argmax_same_as_full_in_set": checks,
              "agreement": agree, "replay_predicted_adaptive_speedup": predicted,
              "repeats": args.repeats, "load_average_1min_before_after_timing": load, "threads": torch.get_num_threads(),
              "note": "timings indicative (shared 2-core CPU); speedups are replay predictions (profile " + PROFILE + ")"}
    atomic_write(OUTPUT, lambda f: f.write(json.dumps(result, indent=1).encode()))
    print(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
