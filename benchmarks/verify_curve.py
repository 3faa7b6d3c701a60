r"""The verification curve per q4 kernel path: a model's forwards over 1 … 9 new tokens at context 128 (the costs the
controller prices), t(n) and t(n)/t(1), for each code path of ``hf_adaspec/kernels/q4.c`` this CPU runs (AVX2,
AVX-VNNI, AVX512-VNNI: ``q4.PATHS``), with an A/A (the first path timed twice).

One process, one model loaded in q4 with its head quantized and enabled, each forward timed as the engine's
calibration times it (``costs.table.ForwardProbe``: n new tokens on top of a 128-token cache, every position's logits
kept, as a verification keeps them, with the attention speculative requests swap in). Each path's row calls the
kernel through ``q4.linear`` (its checks, the path capped); ``shipped`` is ``Q4Linear``'s own forward (the fastest
path, its call bound once per layer), what ``generate`` runs. Each round times, per width, every row in an order that
alternates between rounds; medians over rounds (the first 2 dropped). ``--llama-bench`` (repeatable,
``label=path`` or a path) gives llama.cpp's own curve on the same file: each binary's ``llama-bench -p 1,2,…,9 -n 0
-r 1 -d <--llama-depth>`` once per round after ours, binaries in alternating order, medians over the same rounds
(``--llama-depth 128``: at our context). The processor's flags and the variables that cap the paths are recorded.
Last line: one JSON object (also written to ``--out``, with the command).

    python benchmarks/verify_curve.py --model qwen2.5-coder-1.5b --rounds 10 \
        --llama-bench ~/.cache/llama-cpp-anchor/build-native/bin/llama-bench

A CPU with AVX-VNNI and no AVX-512 reproduced on an AVX-512 one (torch at AVX2, the kernel at most AVX-VNNI):

    PYTHONPATH=benchmarks/avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2_VNNI HF_ADASPEC_Q4_PATH=avx_vnni \
        python benchmarks/verify_curve.py --rounds 8 --llama-depth 128 --llama-bench avxvnni=<build>/bin/llama-bench
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

import hf_adaspec
from hf_adaspec.backend import hf_compat
from hf_adaspec.costs.table import ForwardProbe
from hf_adaspec.kernels import q4, q4_layer
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


def _llama_bench(binary: str, model: str, widths: list[int], threads: int, depth: int) -> dict[str, float]:
    """llama-bench's ms per n-token prompt forward after ``depth`` tokens on the preset's GGUF file (its -p n, mean of
    1 repetition after its warmup). Raises CalledProcessError when llama-bench fails."""
    asset = next(v for v in vars(PRESETS[model]).values() if isinstance(v, assets.GgufAsset))
    command = [binary, "-m", str(assets.assemble(asset)), "-p", ",".join(map(str, widths)), "-n", "0"]
    command += ["-t", str(threads), "-r", "1", "-d", str(depth), "-o", "json"]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return {str(row["n_prompt"]): row["avg_ns"] / 1e6 for row in json.loads(done.stdout)}


_ENV = ("ATEN_CPU_CAPABILITY", q4.PATH_ENV, "ONEDNN_MAX_CPU_ISA", "PYTHONPATH")  # what caps the paths, recorded


def _cpu_flags() -> list[str]:
    """The processor's vector flags as Linux names them (empty elsewhere)."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return []
    line = next((row for row in info.read_text().splitlines() if row.startswith("flags")), "")
    return sorted(f for f in line.split(":")[-1].split() if f.startswith(("avx", "amx", "fma", "f16c")))


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--widths", default="1,2,3,4,5,6,7,8,9")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--llama-bench", action="append", default=[], help="[label=]llama-bench binary for llama.cpp's curve"
    )
    parser.add_argument("--llama-depth", type=int, default=0, help="llama-bench's -d: tokens in the cache before")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    widths = [int(w) for w in args.widths.split(",")]
    benches = dict(b.split("=", 1) if "=" in b else ("llama.cpp", b) for b in args.llama_bench)
    ours = {"shipped", *q4.PATHS[1:], *(f"{p}_again" for p in q4.PATHS[1:])}
    if set(benches) & ours:
        raise SystemExit(f"--llama-bench labels {sorted(set(benches) & ours)} name our curves; choose others")
    model = hf_adaspec.enable(hf_adaspec.load(args.model, quantization="q4", quantize_lm_head=True).model)  # as decoded
    directory = next(m for m in model.modules() if isinstance(m, q4_layer.Q4Linear)).directory
    paths = [p for p in q4.PATHS[1:] if q4.path(directory, p) == p]
    native, ms = q4_layer.Q4Linear.forward, {}
    variants = {p: _forward_on(p) for p in paths} | {f"{paths[0]}_again": _forward_on(paths[0]), "shipped": native}
    with torch.no_grad(), hf_compat.speculative_attention(hf_compat.AttentionSwap(model)):
        probe = ForwardProbe(model, 128, max(widths))
        for r in range(args.rounds + 2):
            for n in widths:
                for name in list(variants) if r % 2 else list(variants)[::-1]:
                    q4_layer.Q4Linear.forward = variants[name]
                    elapsed = probe.time_ms(n)
                    if r >= 2:
                        ms.setdefault(name, {}).setdefault(str(n), []).append(elapsed)
            q4_layer.Q4Linear.forward = native
            for label in list(benches) if r % 2 else list(benches)[::-1]:
                curve = _llama_bench(benches[label], args.model, widths, torch.get_num_threads(), args.llama_depth)
                for n, t in curve.items():
                    if r >= 2:
                        ms.setdefault(label, {}).setdefault(n, []).append(t)
    q4_layer.Q4Linear.forward = native
    out = {name: {n: round(statistics.median(v), 2) for n, v in per.items()} for name, per in ms.items()}
    ratios = {name: {n: round(t / curve[str(widths[0])], 3) for n, t in curve.items()} for name, curve in out.items()}
    for name in out:
        print(f"{name:>16}: " + "  ".join(f"{n}:{out[name][n]:.1f} ({ratios[name][n]:.2f})" for n in out[name]))
    result = {
        "command": "python " + " ".join(sys.argv),
        "env": {k: os.environ[k] for k in _ENV if k in os.environ},
        "model": args.model,
        "cpu": processor_name(),
        "cpu_flags": _cpu_flags(),
        "q4_paths": paths,
        "threads": torch.get_num_threads(),
        "aten_cpu": torch.backends.cpu.get_cpu_capability(),
        "rounds": args.rounds,
        "context": 128,
        "llama_bench": {"binaries": benches, "depth": args.llama_depth, "repetitions": 1} if benches else None,
        "ms": out,
        "t(n)/t(1)": ratios,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
