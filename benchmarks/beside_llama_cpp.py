"""hf-adaspec beside llama.cpp on a bench's prompts, in one run: per prompt, our methods and llama.cpp's, interleaved.

``hf-adaspec bench`` and ``llama_cpp_prompts.py`` run one after the other, minutes apart; on a machine whose speed
drifts (a shared host) their ratio then measures the drift as well. Here each prompt runs three units in an order
that rotates from prompt to prompt: ours (``bench.run_prompt``: plain, plain again for the A/A spread, adaptive,
learned state per method as the bench keeps it, greedy outputs checked against plain), llama.cpp's plain and
llama.cpp's speculative decoding (the 0.5B draft; ``llama_cpp_prompts``' commands and timing). Tokens/s over wall
time, prefill included on both sides; per category the geometric mean over its prompts, overall the geometric mean
over categories (README's tables). Run it alone on the machine. Usage, from the project root:

    python benchmarks/beside_llama_cpp.py --split held-out --per-category 1 \\
        --bin ~/.cache/llama-cpp-anchor/build-native/bin --output benchmarks/results/beside_spec_bench_heldout.json
    python benchmarks/beside_llama_cpp.py --prompts benchmarks/workloads/code.jsonl --per-category 4 \\
        --bin ~/.cache/llama-cpp-anchor/build-native/bin --output benchmarks/results/beside_code.json

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from pathlib import Path

import torch

from hf_adaspec.bench.bench import run_prompt
from hf_adaspec.bench.prompts import SPEC_BENCH, Prompt, load_prompts
from hf_adaspec.cli.pair import load_pair
from hf_adaspec.machine import processor_name
from llama_cpp_prompts import BIN, _gguf, _plain, _speculative  # benchmarks/, on sys.path when this script runs

OURS = ["plain", "plain-again", "adaptive"]
COLUMNS = OURS + ["llama.cpp plain", "llama.cpp speculative"]


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _prompt_row(tgt, drf, prompt: Prompt, rotation: int, cfg: dict, llama: dict) -> dict:
    """One prompt's tokens/s per column, its three units run in the order ``rotation`` gives."""
    text = tgt.tokenizer.apply_chat_template(prompt.messages(), add_generation_prompt=True, tokenize=False)
    n, threads, bin_dir = cfg["max_new_tokens"], llama["threads"], llama["bin"]
    row: dict = {"question_id": prompt.question_id, "category": prompt.category}

    def ours() -> None:
        runs = run_prompt(tgt.model, tgt.tokenizer, drf.model, prompt, OURS, rotation, cfg).runs
        row.update({r.method: round(r.tokens_per_s, 3) for r in runs})
        row["greedy_mismatches"] = [r.method for r in runs if r.method != "plain" and not r.matches_plain]

    units = [ours,
             lambda: row.update({"llama.cpp plain": round(_plain(bin_dir, llama["target"], text, n, threads), 3)}),
             lambda: row.update({"llama.cpp speculative": round(
                 _speculative(bin_dir, llama["target"], llama["draft"], text, n, threads), 3)})]
    for unit in units[rotation % 3:] + units[:rotation % 3]:
        unit()
    return row


def _summary(rows: list[dict]) -> dict:
    """Per category and overall (geometric mean of the categories): tokens/s per column and the ratios."""
    cats: dict[str, list[dict]] = {}
    for r in rows:
        cats.setdefault(r["category"], []).append(r)
    table = {c: {k: _geomean([r[k] for r in rs]) for k in COLUMNS} for c, rs in cats.items()}
    table["overall"] = {k: _geomean([table[c][k] for c in cats]) for k in COLUMNS}
    for cell in table.values():
        cell.update({"aa": cell["plain-again"] / cell["plain"],
                     "plain_over_llama_cpp_plain": cell["plain"] / cell["llama.cpp plain"],
                     "adaptive_over_llama_cpp_plain": cell["adaptive"] / cell["llama.cpp plain"],
                     "adaptive_over_plain": cell["adaptive"] / cell["plain"]})
    return {c: {k: round(v, 3) for k, v in cell.items()} for c, cell in table.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=Path, default=SPEC_BENCH)
    ap.add_argument("--split", default="all")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--bin", type=Path, default=BIN, help="llama.cpp's bin folder (llama_cpp_anchor.sh's build)")
    ap.add_argument("--output", type=Path, required=True)
    args = ap.parse_args()
    prompts = load_prompts(args.prompts, args.per_category, None, args.split)
    tgt, drf = load_pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", "auto", "bfloat16")
    llama = {"bin": args.bin, "threads": args.threads, "target": _gguf("qwen2.5-coder-1.5b"),
             "draft": _gguf("qwen2.5-coder-0.5b")}
    cfg = {"fixed_k": 5, "max_new_tokens": args.max_new_tokens, "repeats": 1, "states": {}}
    run_prompt(tgt.model, tgt.tokenizer, drf.model, Prompt(-1, "warm-up", "Say hello."), OURS, 0,
               {"fixed_k": 5, "max_new_tokens": 8})
    rows = []
    for i, prompt in enumerate(prompts):
        rows.append(_prompt_row(tgt, drf, prompt, i, cfg, llama))
        print(rows[-1], flush=True)
    summary = _summary(rows)
    doc = {"processor": processor_name(), "machine": platform.machine(), "aten_cpu": torch.backends.cpu.get_cpu_capability(),
           "threads": args.threads, "formats": {"target": tgt.format_label, "draft": drf.format_label},
           "llama_cpp_bin": str(args.bin), "prompts": str(args.prompts), "split": args.split,
           "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
           "greedy_mismatches": sum(len(r["greedy_mismatches"]) for r in rows), "tokens_per_s": summary, "runs": rows}
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"output": str(args.output), "overall": summary["overall"],
                      "greedy_mismatches": doc["greedy_mismatches"]}))


if __name__ == "__main__":
    main()
