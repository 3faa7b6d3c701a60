r"""The verification curve per q4 kernel path: a model's forwards over 1 … 9 new tokens at context 128 (the costs the
controller prices), t(n) and t(n)/t(1), for each code path of ``hf_adaspec/kernels/q4.c`` this CPU runs, with an
A/A (the first path timed twice).

One process, one model loaded in q4 with its head quantized and enabled (its lean attention, as ``generate`` runs
it). Each round times, per width, every path in an order
that alternates between rounds; medians over rounds (the first 2 dropped). ``llama-bench -p 1,2,3,5,9`` gives
llama.cpp's own curve on the same file (``--llama-bench``). Last line: one JSON object.

    python benchmarks/verify_curve.py --model qwen2.5-coder-1.5b --rounds 10 \
        --llama-bench ~/.cache/llama-cpp-anchor/build-native/bin/llama-bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time

import torch
from transformers import DynamicCache

import hf_adaspec
from hf_adaspec.kernels import q4
from hf_adaspec.machine import processor_name
from hf_adaspec.models import assets
from hf_adaspec.models.presets import PRESETS


def _forward_on(ceiling: str):
    """A ``Q4Linear.forward`` whose kernel takes at most path ``ceiling``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = q4.linear(
            x.reshape(-1, self.in_features),
            self.blocks,
            self.kind_ids,
            self.rows,
            self.in_features,
            self.directory,
            self.bias,
            ceiling=ceiling,
            n=self.out_features,
        )
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    return forward


def _llama_bench(binary: str, model: str, widths: list[int], threads: int) -> dict[str, float]:
    """llama-bench's ms per n-token prompt forward on the preset's GGUF file (its -p n, mean of its repetitions)."""
    asset = next(v for v in vars(PRESETS[model]).values() if isinstance(v, assets.GgufAsset))
    done = subprocess.run(
        [
            binary,
            "-m",
            str(assets.assemble(asset)),
            "-p",
            ",".join(map(str, widths)),
            "-n",
            "0",
            "-t",
            str(threads),
            "-r",
            "5",
            "-o",
            "json",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return {str(row["n_prompt"]): round(row["avg_ns"] / 1e6, 2) for row in json.loads(done.stdout)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--widths", default="1,2,3,4,5,6,7,8,9")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--llama-bench", default=None, help="llama-bench binary for llama.cpp's curve (optional)")
    args = parser.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    model = hf_adaspec.enable(hf_adaspec.load(args.model, quantization="q4", quantize_lm_head=True).model)  # as decoded
    directory = next(m for m in model.modules() if isinstance(m, q4.Q4Linear)).directory
    paths = [p for p in q4.PATHS[1:] if q4.path(directory, p) == p]
    variants = {p: _forward_on(p) for p in paths} | {f"{paths[0]}_again": _forward_on(paths[0])}
    native, cache, ms = q4.Q4Linear.forward, DynamicCache(), {}
    with torch.no_grad():
        model(input_ids=torch.randint(0, 10000, (1, 128)), past_key_values=cache, use_cache=True)
        for r in range(args.rounds + 2):
            for n in widths:
                ids = torch.randint(0, 10000, (1, n))
                for name in list(variants) if r % 2 else list(variants)[::-1]:
                    q4.Q4Linear.forward = variants[name]
                    start = time.perf_counter()
                    model(input_ids=ids, past_key_values=cache, use_cache=True)
                    if r >= 2:
                        ms.setdefault(name, {}).setdefault(str(n), []).append((time.perf_counter() - start) * 1e3)
                    cache.crop(-n)
    q4.Q4Linear.forward = native
    out = {name: {n: round(statistics.median(v), 2) for n, v in per.items()} for name, per in ms.items()}
    if args.llama_bench:
        out["llama.cpp"] = _llama_bench(args.llama_bench, args.model, widths, torch.get_num_threads())
    ratios = {name: {n: round(t / curve[str(widths[0])], 3) for n, t in curve.items()} for name, curve in out.items()}
    for name in out:
        print(f"{name:>16}: " + "  ".join(f"{n}:{out[name][n]:.1f} ({ratios[name][n]:.2f})" for n in out[name]))
    print(
        json.dumps(
            {
                "model": args.model,
                "cpu": processor_name(),
                "threads": torch.get_num_threads(),
                "aten_cpu": torch.backends.cpu.get_cpu_capability(),
                "rounds": args.rounds,
                "context": 128,
                "ms": out,
                "t(n)/t(1)": ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
