"""The draft's output head over a frequency-ranked vocabulary (FR-Spec, issue 71 item 3): cost, acceptance, and
``adaptive``'s wall clock with and without it, on held-out prompts.

The ranking: token frequencies of the draft's tokenizer over text that is no benchmark's and not what a workload is
built from: the prose (README, METADATA, .md, .rst) and one file in eight of the Python source of the installed
third-party packages (vendored copies and tests left out; the code workload is CPython's standard library, which
is not there), and, where ``wordfreq`` is importable (``pip install wordfreq``), its English word frequencies (each
word as " word", " Word" and "Word"); the three sources weighted alike, special tokens first. Deterministic.

Measured, for each ``--sizes`` V':
- the head's product alone and the draft's 1-token forward at a 128-token context, full and ranked (ms, medians
  of interleaved rounds);
- acceptance along the committed greedy traces (``benchmarks/traces``: the target's outputs and the draft's
  teacher-forced argmax at each output position) of the held-out Spec-Bench prompts and the code workload: α full;
  ``lost``, the positions where the draft's argmax was the target's token and that token is outside the subset (a
  ranked draft cannot propose it); ``gain_max``, where the full draft missed and its argmax is outside while the
  target's token is inside (a ranked draft may hit: an upper bound).
With ``--wall-clock``: for the first size, held-out Spec-Bench (``--per-category``) and code prompts
(``--code-per-category``), 256 new tokens: plain, plain again (A/A), ``adaptive`` with the full draft and with the
ranked one, interleaved per prompt (rotating order), each method learning into its own state from a fresh start.

    python benchmarks/ranked_draft.py --sizes 65536 32768 --wall-clock \\
        --output benchmarks/results/<cpu>/ranked_draft.json

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from hf_adaspec.bench.bench import run_prompt
from hf_adaspec.bench.prompts import SPEC_BENCH, Prompt, load_prompts, split_of
from hf_adaspec.cli.pair import load_pair
from hf_adaspec.machine import processor_name
from hf_adaspec.models.ranked_head import rank_output_head

ROOT = Path(__file__).resolve().parents[1]
WARM_UP = {"fixed_k": 5, "max_new_tokens": 8}  # its own fresh state: nothing learned is kept
EXCLUDED = ("_vendor", "vendored", "third_party", "backports", "/tests/", "/test/")


def _corpus(site: Path) -> tuple[list[str], list[str]]:
    """(prose texts, code texts) of the installed packages under ``site``, in path order."""
    prose, code = [], []
    for path in sorted(site.rglob("*")):
        name = str(path)
        if not path.is_file() or any(part in name for part in EXCLUDED):
            continue
        is_prose = path.suffix in (".md", ".rst") or path.name == "METADATA"
        eighth = int(hashlib.sha256(str(path.relative_to(site)).encode()).hexdigest(), 16) % 8 == 0
        if is_prose or (path.suffix == ".py" and eighth):
            (prose if is_prose else code).append(path.read_text(errors="ignore"))
    return prose, code


def _counts(tokenizer, texts: list[str], weights: list[float] | None = None) -> np.ndarray:
    """Token counts [V] of ``texts`` (each weighted by ``weights``, else 1)."""
    counts = np.zeros(len(tokenizer), dtype=np.float64)
    for i, text in enumerate(texts):
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        np.add.at(counts, ids[ids < len(counts)], 1.0 if weights is None else weights[i])
    return counts


def ranking(tokenizer) -> tuple[torch.Tensor, list[str]]:
    """Vocabulary ids [V] by falling frequency (ties by id), special tokens first, and the sources used."""
    site = Path(torch.__file__).resolve().parents[1]
    prose, code = _corpus(site)
    parts, sources = [_counts(tokenizer, prose), _counts(tokenizer, code)], ["package prose", "package code"]
    try:
        import wordfreq  # optional: general English
    except ImportError:
        wordfreq = None
    if wordfreq is not None:
        words = wordfreq.top_n_list("en", 200_000, wordlist="large")
        freq = [wordfreq.word_frequency(w, "en", wordlist="large") for w in words]
        forms = [f for w in words for f in (" " + w, " " + w.capitalize(), w.capitalize())]
        weights = [f * share for f in freq for share in (0.85, 0.1, 0.05)]
        parts.append(_counts(tokenizer, forms, weights))
        sources.append("wordfreq (English, large)")
    score = sum(p / p.sum() for p in parts)
    score[list(tokenizer.all_special_ids)] = math.inf
    return torch.from_numpy(np.lexsort((np.arange(len(score)), -score))), sources


def trace_acceptance(ids: torch.Tensor, vocab: int) -> dict:
    """Per group (held-out Spec-Bench, code): α of the full draft, and ``lost`` / ``gain_max`` for the subset."""
    inside = np.zeros(vocab, dtype=bool)
    inside[ids.numpy()] = True
    groups: dict[str, list[int]] = {}
    for path in sorted((ROOT / "benchmarks" / "traces").glob("*.json")):
        t = json.loads(path.read_text())
        group = {"spec_bench": "spec_bench held-out", "code": "code"}.get(t["source"])
        if group is None or (group != "code" and split_of(t["question_id"]) != "held-out"):
            continue
        target = np.asarray(t["tokens"][t["prompt_len"] :])
        draft = np.asarray(t["draft_next"][: len(target)])
        match = draft == target
        counts = groups.setdefault(group, [0, 0, 0, 0])
        counts[0] += len(target)
        counts[1] += int(match.sum())
        counts[2] += int((match & ~inside[target]).sum())
        counts[3] += int((~match & ~inside[draft] & inside[target]).sum())
    return {
        g: {"positions": n, "alpha_full": round(m / n, 4), "lost": round(lost / n, 4), "gain_max": round(gain / n, 4)}
        for g, (n, m, lost, gain) in groups.items()
    }


def _forward_ms(model, head, context: int, rounds: list[float]) -> None:
    """One 1-token forward of ``model`` with ``head`` as its output head after ``context`` tokens (ms, median of 8)."""
    model.set_output_embeddings(head)
    ids = torch.arange(100, 100 + context)[None]
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
        times = []
        for _ in range(10):
            start = time.perf_counter()
            model(torch.tensor([[7]]), past_key_values=cache, use_cache=True)
            times.append((time.perf_counter() - start) * 1e3)
            cache.crop(-1)
    rounds.append(statistics.median(times[2:]))


def costs(draft, ranked_heads: dict[int, torch.nn.Module], rounds: int = 7) -> dict:
    """Head alone and the draft's 1-token forward, full and each ranked size, interleaved rounds (ms, medians)."""
    full = draft.get_output_embeddings()
    heads = {"full": full, **{str(n): h for n, h in ranked_heads.items()}}
    x = torch.randn(1, 1, full.in_features)
    head_ms: dict[str, list[float]] = {k: [] for k in heads}
    step_ms: dict[str, list[float]] = {k: [] for k in heads}
    with torch.no_grad():
        for _ in range(rounds):
            for name, head in heads.items():
                times = []
                for _ in range(30):
                    start = time.perf_counter()
                    head(x)
                    times.append((time.perf_counter() - start) * 1e3)
                head_ms[name].append(statistics.median(times[5:]))
                _forward_ms(draft, head, 128, step_ms[name])
    draft.set_output_embeddings(full)
    return {
        k: {"head_ms": round(statistics.median(head_ms[k]), 3), "forward_ms": round(statistics.median(step_ms[k]), 2)}
        for k in heads
    }


def _row(tgt, draft, ranked, prompt, i: int, states: tuple[dict, dict], max_new_tokens: int) -> dict:
    """One prompt's tokens/s: plain, plain again and adaptive with ``draft`` (one unit), adaptive with ``ranked``
    (the other), the units' order alternating with ``i``."""
    row = {"question_id": prompt.question_id, "category": prompt.category}
    methods = (["plain", "plain-again", "adaptive"], ["adaptive"])
    for unit in (0, 1) if i % 2 == 0 else (1, 0):
        cfg = {"fixed_k": 5, "max_new_tokens": max_new_tokens, "states": states[unit]}
        runs = run_prompt(tgt.model, tgt.tokenizer, (draft, ranked)[unit], prompt, methods[unit], i, cfg).runs
        if unit == 0:
            row.update({r.method: round(r.tokens_per_s, 3) for r in runs})
            row["adaptive_matches_plain"] = next(r.matches_plain for r in runs if r.method == "adaptive")
        else:
            row.update({"adaptive-ranked": round(runs[0].tokens_per_s, 3), "ranked_plain_share": runs[0].plain_share})
    return row


def wall_clock(tgt, draft, ranked, prompts, max_new_tokens: int) -> list[dict]:
    """Per prompt tokens/s: plain, plain again, adaptive (full draft), adaptive (ranked draft); interleaved, each
    method learning into its own state across the prompts."""
    states, rows = ({}, {}), []
    for model in (draft, ranked):  # a draft's first use calibrates the pair's step costs: kept out of the timings
        run_prompt(tgt.model, tgt.tokenizer, model, Prompt(-1, "warm-up", "Say hello."), ["adaptive"], 0, WARM_UP)
    for i, prompt in enumerate(prompts):
        rows.append(_row(tgt, draft, ranked, prompt, i, states, max_new_tokens))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def _summary(rows: list[dict]) -> dict:
    """Geometric means over prompts and the ratios that decide."""
    cols = ("plain", "plain-again", "adaptive", "adaptive-ranked")
    mean = {c: math.exp(statistics.fmean(math.log(r[c]) for r in rows)) for c in cols}
    return {
        **{c: round(v, 3) for c, v in mean.items()},
        "aa": round(mean["plain-again"] / mean["plain"], 3),
        "ranked_over_full": round(mean["adaptive-ranked"] / mean["adaptive"], 3),
        "adaptive_over_plain": round(mean["adaptive"] / mean["plain"], 3),
        "ranked_over_plain": round(mean["adaptive-ranked"] / mean["plain"], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[65536])
    ap.add_argument("--wall-clock", action="store_true")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--code-per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--output", type=Path, required=True)
    args = ap.parse_args()
    tgt, drf = load_pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "auto", "bfloat16")
    order, sources = ranking(drf.tokenizer)
    vocab = drf.model.get_output_embeddings().out_features
    order = order[order < vocab]
    ranked = {n: rank_output_head(copy.deepcopy(drf.model), order[:n].sort().values) for n in args.sizes}
    result: dict = {
        "processor": processor_name(),
        "ranking_sources": sources,
        "ranking_sha256": hashlib.sha256(order.numpy().tobytes()).hexdigest()[:16],
        "acceptance": {n: trace_acceptance(order[:n], vocab) for n in args.sizes},
        "costs": costs(drf.model, {n: m.get_output_embeddings().head for n, m in ranked.items()}),
    }
    if args.wall_clock:
        spec = load_prompts(SPEC_BENCH, args.per_category, split="held-out")
        code = load_prompts(ROOT / "benchmarks" / "workloads" / "code.jsonl", args.code_per_category)
        for name, prompts in (("spec_bench_held_out", spec), ("code", code)):
            rows = wall_clock(tgt, drf.model, ranked[args.sizes[0]], prompts, args.max_new_tokens)
            result[name] = {"size": args.sizes[0], "summary": _summary(rows), "rows": rows}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(args.output)
    print(
        json.dumps(
            {k: v for k, v in result.items() if k not in ("spec_bench_held_out", "code")}
            | {k: result[k]["summary"] for k in ("spec_bench_held_out", "code") if k in result}
        )
    )


if __name__ == "__main__":
    main()
