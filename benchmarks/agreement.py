"""Top-1 agreement of weight formats with the dense model, over longer continuations than the probe's (issue 56).

``quantization="auto"`` scores each format on ``format_quality.QUALITY_TOKENS`` dense greedy tokens per prompt
(3 prompts: one token is half a percent). This script scores the same way on ``--tokens`` per prompt: the dense
model in ``--dtype`` (bfloat16, the probe's reference) generates greedily from ``format_quality.QUALITY_PROMPTS``,
and each format of ``--formats`` (``auto``: ``hf_adaspec.load(name)`` as a user gets it; any ``formats.FORMATS``
name; ``none-float32``: the dense weights in float32, the reference's own rounding floor) reads those tokens
teacher-forced (``format_quality.agreement``). Run it alone on the machine:

    python benchmarks/agreement.py --model qwen2.5-coder-1.5b --tokens 256 --formats auto none-float32

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json

import torch

import hf_adaspec
from hf_adaspec.machine import processor_name
from hf_adaspec.models.format_quality import agreement, dense_reference


def _load(name: str, fmt: str, dtype: str) -> tuple[torch.nn.Module, str]:
    """The model of ``name`` in format ``fmt`` and what was loaded (``auto``: the cached choice's line)."""
    if fmt == "none-float32":
        return hf_adaspec.load(name, quantization="none", dtype="float32").model, "none, float32"
    lines: list[str] = []
    loaded = hf_adaspec.load(name, quantization=fmt, dtype=dtype, log=lines.append)
    return loaded.model, (lines[-1] if lines and fmt == "auto" else fmt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=256, help="dense greedy tokens per prompt")
    ap.add_argument("--formats", nargs="+", default=["auto", "none-float32"])
    ap.add_argument("--dtype", default="bfloat16", help="the reference's (and the formats') dtype")
    args = ap.parse_args()
    dense = hf_adaspec.load(args.model, quantization="none", dtype=args.dtype)
    refs = dense_reference(dense.model, dense.tokenizer, args.tokens)
    del dense
    gc.collect()
    rows = {}
    for fmt in args.formats:
        model, what = _load(args.model, fmt, args.dtype)
        top1, first = agreement(model, refs)
        rows[fmt] = {"loaded": what, "top1": round(top1, 4), "first_divergence": round(first, 1)}
        print(f"{fmt}: top-1 {top1:.4f}, first divergence {first:.1f} ({what})", flush=True)
        del model
        gc.collect()
    print(
        json.dumps(
            {
                "model": args.model,
                "processor": processor_name(),
                "reference_dtype": args.dtype,
                "tokens_per_prompt": args.tokens,
                "prompts": len(refs),
                "formats": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
