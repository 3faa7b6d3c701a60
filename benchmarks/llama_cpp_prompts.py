"""llama.cpp on a bench's prompts: the same GGUF files, chat template, greedy, 256 new tokens (issue 44).

The llama.cpp columns of README's results: for each prompt ``hf-adaspec bench`` selects (same ``--prompts``,
``--split``, ``--per-category``), ``llama-completion`` (plain) and ``llama-speculative-simple`` (the 0.5B draft,
``--spec-type draft-simple``) on the target's chat-templated text; tokens/s = new tokens over prompt
processing plus decoding (model loading excluded, prefill included, like the bench's). Binaries: those
``../shared/tools/llama_cpp_anchor.sh`` builds (``--bin``, default the native build in its cache). Run it alone
on the machine (it uses every core it is given by ``--threads``). Per category: geometric mean of tokens/s.

    python benchmarks/llama_cpp_prompts.py --split held-out --per-category 1 \\
        --output benchmarks/results/llama_cpp_spec_bench_heldout.json
    python benchmarks/llama_cpp_prompts.py --prompts benchmarks/workloads/code.jsonl --per-category 4 \\
        --output benchmarks/results/llama_cpp_code.json

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
from pathlib import Path

from transformers import AutoTokenizer

from hf_adaspec.bench.prompts import SPEC_BENCH, load_prompts
from hf_adaspec.models import assets
from hf_adaspec.models.loading import resolve
from hf_adaspec.models.presets import PRESETS

BIN = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-cpp-anchor" / "build-native" / "bin"


def _gguf(name: str) -> str:
    asset = next(v for v in vars(PRESETS[name]).values() if isinstance(v, assets.GgufAsset))
    return str(assets.assemble(asset))


def _plain(bin_dir: Path, target: str, text: str, n: int, threads: int) -> float:
    out = subprocess.run([bin_dir / "llama-completion", "-m", target, "-p", text, "-n", str(n), "-t", str(threads),
                          "--temp", "0", "-c", "4096", "-no-cnv", "--no-display-prompt"],
                         capture_output=True, text=True, check=True).stderr
    prompt_ms = float(re.search(r"prompt eval time =\s+([0-9.]+) ms", out).group(1))
    eval_ms, runs = re.search(r"\n[^\n]*?\beval time =\s+([0-9.]+) ms /\s+(\d+) runs", out).groups()
    return (int(runs) + 1) / ((prompt_ms + float(eval_ms)) / 1e3)  # +1: the token the prompt's forward gives


def _speculative(bin_dir: Path, target: str, draft: str, text: str, n: int, threads: int) -> float:
    out = subprocess.run([bin_dir / "llama-speculative-simple", "-m", target, "-md", draft, "-p", text, "-n", str(n),
                          "-t", str(threads), "--temp", "0", "-c", "4096", "--spec-type", "draft-simple"],
                         capture_output=True, text=True, check=True).stderr
    enc = float(re.search(r"encoded\s+\d+ tokens in\s+([0-9.]+) seconds", out).group(1))
    new, dec = re.search(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds", out).groups()
    return int(new) / (enc + float(dec))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=Path, default=SPEC_BENCH)
    ap.add_argument("--split", default="all")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--bin", type=Path, default=BIN)
    ap.add_argument("--output", type=Path, required=True)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(resolve("qwen2.5-coder-1.5b"))
    target, draft = _gguf("qwen2.5-coder-1.5b"), _gguf("qwen2.5-coder-0.5b")
    rows = []
    for p in load_prompts(args.prompts, args.per_category, None, args.split):
        text = tok.apply_chat_template(p.messages(), add_generation_prompt=True, tokenize=False)
        row = {"question_id": p.question_id, "category": p.category,
               "plain": round(_plain(args.bin, target, text, args.max_new_tokens, args.threads), 3),
               "speculative": round(_speculative(args.bin, target, draft, text, args.max_new_tokens, args.threads), 3)}
        rows.append(row)
        print(row, flush=True)
    cats = {}
    for r in rows:
        cats.setdefault(r["category"], []).append(r)
    geo = lambda xs: round(math.exp(sum(math.log(x) for x in xs) / len(xs)), 2)  # noqa: E731
    summary = {c: {k: geo([r[k] for r in rs]) for k in ("plain", "speculative")} for c, rs in cats.items()}
    summary["overall"] = {k: geo([r[k] for r in rows]) for k in ("plain", "speculative")}
    doc = {"bin": str(args.bin), "threads": args.threads, "prompts": str(args.prompts), "split": args.split,
           "per_category": args.per_category, "max_new_tokens": args.max_new_tokens, "tokens_per_s": summary,
           "runs": rows}
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps({"output": str(args.output), "tokens_per_s": summary}))


if __name__ == "__main__":
    main()
