"""Perplexity of our weight formats against llama.cpp's ``llama-perplexity``, same GGUF file, same text (issue 56).

Held-out text: a file outside every benchmark and workload (default /usr/share/common-licenses/GPL-3, English
prose; its SHA-256 goes into the JSON). llama.cpp side: ``llama-perplexity -m <gguf> -f <text> -c <n_ctx>
--chunks <n>``, its "Final estimate: PPL = X +/- Y" and its running PPL after each chunk. Our side
(``hf_adaspec.bench.perplexity``, the same scoring): the target's tokenizer (checked token for token against
``llama-tokenize`` where that binary is built), the same chunks, one forward a chunk with ``logits_to_keep``
set to the scored half. Formats: ``auto`` is ``hf_adaspec.load(name)`` as a user gets it (the cached format
choice; the JSON names the format and head it ran); any ``formats.FORMATS`` name loads that format
(``none``: the file's blocks dequantized exactly in ``--dtype``, float32 by default: the quality reference;
``--dense-chunks`` bounds its chunks where it is slow, and the JSON gives llama.cpp's and every format's PPL over
those first chunks too).
Run it alone on the machine (``flock /tmp/adaspec-cpu.lock``):

    python benchmarks/perplexity.py --models qwen2.5-coder-1.5b --formats auto none \\
        --output benchmarks/results/perplexity_qwen2.5-coder-1.5b.json

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_cpp_prompts import BIN, _gguf  # noqa: E402

import hf_adaspec  # noqa: E402
from hf_adaspec.bench.perplexity import chunk_nll, chunks, estimate  # noqa: E402
from hf_adaspec.models.loading import source  # noqa: E402

GPL3 = Path("/usr/share/common-licenses/GPL-3")


def _llama(bin_dir: Path, gguf: str, text: Path, n_ctx: int, n_chunks: int, threads: int) -> dict:
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            bin_dir / "llama-perplexity",
            "-m",
            gguf,
            "-f",
            str(text),
            "-c",
            str(n_ctx),
            "--chunks",
            str(n_chunks),
            "-t",
            str(threads),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    log = out.stdout + out.stderr
    ppl, err = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log).groups()
    running = [float(x) for x in re.findall(r"\[\d+\]([0-9.]+),", log)]
    return {
        "ppl": float(ppl),
        "err": float(err),
        "chunks": len(running),
        "running_ppl": running,
        "tokens": len(running) * (n_ctx - 1 - n_ctx // 2),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _llama_tokens(bin_dir: Path, gguf: str, text: Path) -> list[int] | None:
    tool = bin_dir / "llama-tokenize"
    if not tool.exists():
        return None
    out = subprocess.run(
        [tool, "-m", gguf, "-f", str(text), "--ids", "--log-disable"], capture_output=True, text=True, check=True
    ).stdout
    return ast.literal_eval(out.strip().splitlines()[-1])


def _ours(name: str, fmt: str, dtype: str, token_chunks: list[list[int]]) -> tuple[dict, list[torch.Tensor]]:
    t0 = time.perf_counter()
    lm = hf_adaspec.load(name) if fmt == "auto" else hf_adaspec.load(name, quantization=fmt, dtype=dtype)
    load_s = time.perf_counter() - t0
    n_ctx = len(token_chunks[0])
    keep = n_ctx - n_ctx // 2
    nlls, t0 = [], time.perf_counter()
    for i, c in enumerate(token_chunks):
        ids = torch.tensor(c)
        with torch.inference_mode():
            logits = lm.model(input_ids=ids[None], use_cache=False, logits_to_keep=keep).logits[0]  # [keep, V]
        nlls.append(chunk_nll(logits, ids))
        done = time.perf_counter() - t0
        print(
            f"  {name} {fmt}: chunk {i + 1}/{len(token_chunks)}, {done:.0f} s, "
            f"ETA {done / (i + 1) * (len(token_chunks) - i - 1):.0f} s",
            file=sys.stderr,
            flush=True,
        )
    est = estimate(torch.cat(nlls))
    row = {
        "format": lm.format_label,
        "dtype": str(next(lm.model.parameters()).dtype).removeprefix("torch."),
        "ppl": round(est.ppl, 4),
        "err": round(est.err, 5),
        "chunks": len(token_chunks),
        "tokens": est.tokens,
        "load_s": round(load_s, 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }
    del lm
    return row, nlls


def _model(args: argparse.Namespace, name: str, text: str) -> dict:
    gguf = _gguf(name)
    tokenizer = AutoTokenizer.from_pretrained(source(name).meta())  # the tokenizer files hf_adaspec.load reads
    ids = tokenizer(text)["input_ids"]
    adds_bos = tokenizer.bos_token_id is not None and ids[:1] == [tokenizer.bos_token_id]
    ref = _llama_tokens(args.bin, gguf, args.text)
    all_chunks = chunks(ids, args.n_ctx, args.chunks, tokenizer.bos_token_id if adds_bos else None)
    n = len(all_chunks)
    dense_n = n if args.dense_chunks is None else min(args.dense_chunks, n)
    print(f"{name}: {len(ids)} tokens, {n} chunks of {args.n_ctx}", file=sys.stderr, flush=True)
    doc = {
        "gguf": Path(gguf).name,
        "text_tokens": len(ids),
        "adds_bos": adds_bos,
        "tokens_match_llama_tokenize": None if ref is None else ref == ids,
        "llama_cpp": _llama(args.bin, gguf, args.text, args.n_ctx, n, args.threads),
        "ours": [],
    }
    prefix = {"chunks": dense_n, "llama_cpp_ppl": doc["llama_cpp"]["running_ppl"][dense_n - 1]}
    for fmt in args.formats:
        row, nlls = _ours(name, fmt, args.dtype, all_chunks[:dense_n] if fmt == "none" else all_chunks)
        doc["ours"].append(row)
        prefix[row["format"]] = round(estimate(torch.cat(nlls[:dense_n])).ppl, 4)
        print(row, flush=True)
    doc["first_chunks_ppl"] = prefix
    return doc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen2.5-coder-1.5b"])
    ap.add_argument("--formats", nargs="+", default=["auto"], help="auto (what load(name) gives) or formats' names")
    ap.add_argument("--text", type=Path, default=GPL3)
    ap.add_argument("--n-ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=None, help="at most this many chunks (default: all)")
    ap.add_argument(
        "--dense-chunks",
        type=int,
        default=None,
        help="at most this many chunks for the dense format (none; default: as many as the others)",
    )
    ap.add_argument("--dtype", default="float32", help="dtype of the formats named explicitly (auto: its own)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--bin", type=Path, default=BIN)
    ap.add_argument("--output", type=Path, required=True)
    args = ap.parse_args()
    if not args.text.is_file():
        raise SystemExit(f"--text {args.text}: no such file; pass a held-out English text of at least a few KB")
    raw = args.text.read_bytes()
    doc = {
        "text": str(args.text),
        "text_sha256": hashlib.sha256(raw).hexdigest(),
        "n_ctx": args.n_ctx,
        "threads": args.threads,
        "bin": str(args.bin),
        "torch_threads": torch.get_num_threads(),
        "models": {},
    }
    for name in args.models:
        doc["models"][name] = _model(args, name, raw.decode())
    args.output.write_text(json.dumps(doc, indent=1) + "\n")
    summary = {
        n: {
            "llama_cpp": [m["llama_cpp"]["ppl"], m["llama_cpp"]["err"]],
            **{r["format"]: [r["ppl"], r["err"], r["chunks"]] for r in m["ours"]},
        }
        for n, m in doc["models"].items()
    }
    print(json.dumps({"output": str(args.output), "ppl": summary}))


if __name__ == "__main__":
    main()
