"""llama.cpp on a bench's prompts: the same GGUF files, chat template, greedy, 256 new tokens (issue 44).

The llama.cpp columns of README's results: for each prompt ``hf-adaspec bench`` selects (same ``--prompts``,
``--split``, ``--per-category``), ``llama-completion`` (plain) and ``llama-speculative-simple`` (the 0.5B draft,
``--spec-type draft-simple``) on the target's chat-templated text; tokens/s = new tokens over prompt
processing plus decoding (model loading excluded, prefill included, like the bench's). Binaries: those
``../shared/tools/llama_cpp_anchor.sh`` builds (``--bin``, default the native build in its cache). Run it alone
on the machine (it uses every core it is given by ``--threads``). Per category: geometric mean of tokens/s.

With ``--beside``, hf-adaspec runs in the same process, interleaved per prompt: a bench and this script run
minutes apart, and on a machine whose speed drifts (a shared host) their ratio measures the drift as well. Each
prompt then runs three units in an order that rotates from prompt to prompt: ours (``bench.run_prompt``: plain,
plain again for the A/A spread, ``adaptive``; learned state per method as the bench keeps it; greedy outputs
checked against plain: where one differs, the target's top-2 logit gap where it first does, a near-tie when
small), llama.cpp's plain and its speculative decoding. Overall: the geometric mean over categories (README's). Each row
also keeps ``adaptive``'s last timed run's steps: new tokens, share of plain steps, mean k, acceptance α.
``--repeats N`` times every method N times per prompt and keeps the median (ours: every repeat after the first
starts from the state as it was before the prompt, ``bench.run_prompt``); with N ≥ 3 a row's ``paired`` holds,
for plain-again (the A/A) and ``adaptive``, plain's time over theirs per round: median and 95% bootstrap interval.
``--categories`` keeps those categories.

    python benchmarks/llama_cpp_prompts.py --split held-out --per-category 1 \\
        --output benchmarks/results/llama_cpp_spec_bench_heldout.json
    python benchmarks/llama_cpp_prompts.py --prompts benchmarks/workloads/code.jsonl --per-category 4 \\
        --output benchmarks/results/llama_cpp_code.json
    python benchmarks/llama_cpp_prompts.py --beside --split held-out --per-category 1 \\
        --output benchmarks/results/beside_spec_bench_heldout.json

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import statistics
import subprocess
from pathlib import Path

import torch
from transformers import AutoTokenizer

from hf_adaspec.bench.bench import run_prompt
from hf_adaspec.bench.prompts import SPEC_BENCH, Prompt, load_prompts
from hf_adaspec.cli.pair import load_pair
from hf_adaspec.machine import processor_name
from hf_adaspec.models import assets
from hf_adaspec.models.loading import resolve
from hf_adaspec.models.presets import PRESETS

BIN = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-cpp-anchor" / "build-native" / "bin"


def _gguf(name: str) -> str:
    asset = next(v for v in vars(PRESETS[name]).values() if isinstance(v, assets.GgufAsset))
    return str(assets.assemble(asset))


def _plain(bin_dir: Path, target: str, text: str, n: int, threads: int) -> float:
    out = subprocess.run(
        [
            bin_dir / "llama-completion",
            "-m",
            target,
            "-p",
            text,
            "-n",
            str(n),
            "-t",
            str(threads),
            "--temp",
            "0",
            "-c",
            "4096",
            "-no-cnv",
            "--no-display-prompt",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    prompt_ms = float(re.search(r"prompt eval time =\s+([0-9.]+) ms", out).group(1))
    eval_ms, runs = re.search(r"\n[^\n]*?\beval time =\s+([0-9.]+) ms /\s+(\d+) runs", out).groups()
    return (int(runs) + 1) / ((prompt_ms + float(eval_ms)) / 1e3)  # +1: the token the prompt's forward gives


def _speculative(bin_dir: Path, target: str, draft: str, text: str, n: int, threads: int) -> float:
    out = subprocess.run(
        [
            bin_dir / "llama-speculative-simple",
            "-m",
            target,
            "-md",
            draft,
            "-p",
            text,
            "-n",
            str(n),
            "-t",
            str(threads),
            "--temp",
            "0",
            "-c",
            "4096",
            "--spec-type",
            "draft-simple",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stderr
    enc = float(re.search(r"encoded\s+\d+ tokens in\s+([0-9.]+) seconds", out).group(1))
    new, dec = re.search(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds", out).groups()
    return int(new) / (enc + float(dec))


OURS = ["plain", "plain-again", "adaptive"]
COLUMNS = OURS + ["llama.cpp plain", "llama.cpp speculative"]


def _finite(x: float | None) -> float | None:
    """``x``, or None where it is NaN (nothing drafted) or missing: JSON has no NaN."""
    return None if x is None or math.isnan(x) else x


def _paired(base: tuple[float, ...], other: tuple[float, ...], draws: int = 4000) -> list[float]:
    """[median, low, high] of the per-round ratios base/other (a speedup of ``other`` over ``base``; rounds
    time both methods once each, so round i's times are a pair): the median and a 95% percentile-bootstrap
    interval of it (Efron & Tibshirani 1993, ch. 13), seeded so a file is reproducible."""
    ratios = [b / o for b, o in zip(base, other, strict=True)]
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return [
        round(statistics.median(ratios), 4),
        round(meds[int(0.025 * draws)], 4),
        round(meds[int(0.975 * draws) - 1], 4),
    ]


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _llama_row(prompt, text: str, args, target: str, draft: str) -> dict:
    """One prompt's llama.cpp plain and speculative tokens/s."""
    return {
        "question_id": prompt.question_id,
        "category": prompt.category,
        "plain": round(_plain(args.bin, target, text, args.max_new_tokens, args.threads), 3),
        "speculative": round(_speculative(args.bin, target, draft, text, args.max_new_tokens, args.threads), 3),
    }


def _beside_row(pair, prompt, text: str, rotation: int, args, target: str, draft: str) -> dict:
    """One prompt's tokens/s per column (``COLUMNS``), its three units run in the order ``rotation`` gives."""
    tgt, drf, cfg = pair
    n, threads = args.max_new_tokens, args.threads
    row: dict = {"question_id": prompt.question_id, "category": prompt.category}

    def ours() -> None:
        runs = run_prompt(tgt.model, tgt.tokenizer, drf.model, prompt, OURS, rotation, cfg).runs
        row.update({r.method: round(r.tokens_per_s, 3) for r in runs})
        seconds = {r.method: r.repeat_seconds for r in runs}
        if args.repeats >= 3:  # per round: plain's time over the other's, median and its 95% bootstrap interval
            row["paired"] = {m: _paired(seconds["plain"], seconds[m]) for m in ("plain-again", "adaptive")}
        row["adaptive_steps"] = next(  # its last timed run: why it won or lost (plain steps, k, α)
            {
                "new_tokens": r.new_tokens,
                "plain_share": r.plain_share,
                "mean_k": r.mean_k,
                "acceptance": _finite(r.acceptance),
            }
            for r in runs
            if r.method == "adaptive"
        )
        row["greedy_gap_vs_plain"] = {
            r.method: r.divergence_gap
            for r in runs  # top-2 gap where it first differs
            if r.method != "plain" and not r.matches_plain
        }

    def median(run) -> float:
        return round(statistics.median(run() for _ in range(args.repeats)), 3)

    units = [
        ours,
        lambda: row.update({"llama.cpp plain": median(lambda: _plain(args.bin, target, text, n, threads))}),
        lambda: row.update(
            {"llama.cpp speculative": median(lambda: _speculative(args.bin, target, draft, text, n, threads))}
        ),
    ]
    for unit in units[rotation % 3 :] + units[: rotation % 3]:
        unit()
    return row


def _beside_summary(rows: list[dict]) -> dict:
    """Per category and overall (geometric mean of the categories): tokens/s per column and the ratios."""
    cats: dict[str, list[dict]] = {}
    for r in rows:
        cats.setdefault(r["category"], []).append(r)
    table = {c: {k: _geomean([r[k] for r in rs]) for k in COLUMNS} for c, rs in cats.items()}
    table["overall"] = {k: _geomean([table[c][k] for c in cats]) for k in COLUMNS}
    for cell in table.values():
        cell.update(
            {
                "aa": cell["plain-again"] / cell["plain"],
                "plain_over_llama_cpp_plain": cell["plain"] / cell["llama.cpp plain"],
                "adaptive_over_llama_cpp_plain": cell["adaptive"] / cell["llama.cpp plain"],
                "adaptive_over_plain": cell["adaptive"] / cell["plain"],
            }
        )
    return {c: {k: round(v, 3) for k, v in cell.items()} for c, cell in table.items()}


def _ours():
    """The default pair as ``hf-adaspec bench`` loads it, warmed up (its first ``adaptive`` use calibrates the
    pair's step costs: kept out of the timed runs), and the bench's per-method learned state."""
    tgt, drf = load_pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "auto", "bfloat16")
    run_prompt(
        tgt.model,
        tgt.tokenizer,
        drf.model,
        Prompt(-1, "warm-up", "Say hello."),
        OURS,
        0,
        {"fixed_k": 5, "max_new_tokens": 8},
    )
    return tgt, drf, {"fixed_k": 5, "max_new_tokens": 256, "repeats": 1, "states": {}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=Path, default=SPEC_BENCH)
    ap.add_argument("--split", default="all")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--categories", default=None, help="comma-separated categories to keep (default: all)")
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per method and prompt (median)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--bin", type=Path, default=BIN)
    ap.add_argument("--beside", action="store_true", help="hf-adaspec's plain, A/A and adaptive interleaved per prompt")
    ap.add_argument("--output", type=Path, required=True)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(resolve("qwen2.5-coder-1.5b"))
    target, draft = _gguf("qwen2.5-coder-1.5b"), _gguf("qwen2.5-coder-0.5b")
    pair = _ours() if args.beside else None
    if pair is not None:
        pair[2].update(max_new_tokens=args.max_new_tokens, repeats=args.repeats)
    rows, cats = [], args.categories.split(",") if args.categories else None
    for i, p in enumerate(load_prompts(args.prompts, args.per_category, cats, args.split)):
        text = tok.apply_chat_template(p.messages(), add_generation_prompt=True, tokenize=False)
        rows.append(
            _beside_row(pair, p, text, i, args, target, draft) if pair else _llama_row(p, text, args, target, draft)
        )
        print(rows[-1], flush=True)
    doc = {
        "bin": str(args.bin),
        "threads": args.threads,
        "prompts": str(args.prompts),
        "split": args.split,
        "per_category": args.per_category,
        "categories": args.categories,
        "repeats": args.repeats,
        "max_new_tokens": args.max_new_tokens,
    }
    if pair is not None:
        doc |= _beside_meta(pair, rows)
    else:
        doc["tokens_per_s"] = _llama_summary(rows)
    doc["runs"] = rows
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    tail = {k: doc[k] for k in ("greedy_mismatches", "max_divergence_gap") if k in doc}
    print(json.dumps({"output": str(args.output), "tokens_per_s": doc["tokens_per_s"]["overall"], **tail}))


def _llama_summary(rows: list[dict]) -> dict:
    """llama.cpp's plain and speculative tokens/s per category and overall (geometric means over prompts)."""
    cats: dict[str, list[dict]] = {}
    for r in rows:
        cats.setdefault(r["category"], []).append(r)
    geo = lambda xs: round(_geomean(xs), 2)  # noqa: E731
    summary = {c: {k: geo([r[k] for r in rs]) for k in ("plain", "speculative")} for c, rs in cats.items()}
    summary["overall"] = {k: geo([r[k] for r in rows]) for k in ("plain", "speculative")}
    return summary


def _beside_meta(pair, rows: list[dict]) -> dict:
    """The run's processor, formats, greedy checks and summary (``_beside_summary``)."""
    tgt, drf, _ = pair
    gaps = [g for r in rows for g in r["greedy_gap_vs_plain"].values()]
    return {
        "processor": processor_name(),
        "machine": platform.machine(),
        "aten_cpu": torch.backends.cpu.get_cpu_capability(),
        "formats": {"target": tgt.format_label, "draft": drf.format_label},
        "greedy_mismatches": len(gaps),
        "max_divergence_gap": max((g for g in gaps if g is not None), default=None),
        "tokens_per_s": _beside_summary(rows),
    }


if __name__ == "__main__":
    main()
