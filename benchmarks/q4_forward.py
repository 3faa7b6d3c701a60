"""Interleaved A/B of the q4 kernel (``hf_adaspec/kernels/q4.{py,c}``) of a base commit against this tree's, on
a model's forwards over 1 … 9 new tokens at context 128 (the costs the controller prices), with an A/A.

One process, one model loaded in q4 with its head quantized; every ``Q4Linear`` also holds the base kernel's
packing of its weights (base ``pack`` of this tree's dequantized weight: for a base with another layout, its
requantization, as that base loaded the model). Each round
times, per width, base / new / base again in alternating order; medians over rounds (the first 2 dropped).
``base_again / base`` is the A/A: a new/base ratio inside its spread decides nothing. Last line: one JSON object.

    python benchmarks/q4_forward.py --base 658777c --model qwen2.5-coder-1.5b --widths 1,2,4,6,9 --rounds 14
    PYTHONPATH=benchmarks/avx2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/q4_forward.py ...   # the AVX2 path
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache

import hf_adaspec
from hf_adaspec.kernels import q4
from hf_adaspec.machine import processor_name

ROOT = Path(__file__).resolve().parents[1]


def _base_kernel(commit: str, tmp: Path):
    """The base commit's q4 module (its C source beside it, building into ``tmp``) and whether it has the one-call
    ``linear`` (from 82c15ff; before it, ``matmul``)."""
    texts = {name: subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:hf_adaspec/kernels/{name}"],
                                  check=True, capture_output=True, text=True).stdout for name in ("q4.py", "q4.c")}
    for name, text in texts.items():
        (tmp / name).write_text(text)
    spec = importlib.util.spec_from_file_location("q4_base", tmp / "q4.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, "\ndef linear(" in texts["q4.py"]


def _base_forward(base, one_call: bool, directory: Path):
    """A ``Q4Linear.forward`` through the base kernel."""
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if one_call:
            y = base.linear(flat, self.base_blocks, self.out_features, directory, self.bias)
        else:
            y = base.matmul(flat, self.base_blocks, self.out_features, directory)
            if self.bias is not None:
                y += self.bias
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
    return forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", required=True)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--widths", default="1,2,4,6,9")
    parser.add_argument("--rounds", type=int, default=14)
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = hf_adaspec.load(args.model, quantization="q4", quantize_lm_head=True).model
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        base, one_call = _base_kernel(args.base, Path(tmp))
        for layer in (m for m in model.modules() if isinstance(m, q4.Q4Linear)):
            layer.base_blocks = base.pack(layer.weight_float())
        variants = {"base": _base_forward(base, one_call, Path(tmp)), "new": q4.Q4Linear.forward}
        variants["base_again"] = variants["base"]
        cache, ms = DynamicCache(), {}
        model(input_ids=torch.randint(0, 10000, (1, 128)), past_key_values=cache, use_cache=True)
        for r in range(args.rounds):
            for n in widths:
                ids = torch.randint(0, 10000, (1, n))
                for name in (list(variants) if r % 2 else list(variants)[::-1]):
                    q4.Q4Linear.forward = variants[name]
                    start = time.perf_counter()
                    model(input_ids=ids, past_key_values=cache, use_cache=True)
                    if r >= 2:
                        ms.setdefault(n, {}).setdefault(name, []).append((time.perf_counter() - start) * 1e3)
                    cache.crop(-n)
        q4.Q4Linear.forward = variants["new"]
    out = {str(n): {k: round(statistics.median(v), 2) for k, v in per.items()} for n, per in ms.items()}
    for n, per in out.items():
        per["new/base"] = round(per["new"] / per["base"], 3)
        per["A/A"] = round(per["base_again"] / per["base"], 3)
        print(f"{args.model} {n} tokens: " + ", ".join(f"{k} {v}" for k, v in per.items()), flush=True)
    print(json.dumps({"base": args.base, "model": args.model, "cpu": processor_name(), "threads": torch.get_num_threads(),
                      "aten_cpu": torch.backends.cpu.get_cpu_capability(), "rounds": args.rounds, "ms": out}))


if __name__ == "__main__":
    main()
