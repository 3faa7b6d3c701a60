"""One-off (issue 56, prefill): a q4 layer's product over M activation rows by the q4 kernel against dequantizing its
weight to bf16 (``q4.dequantize_rows``) and torch's bf16 matmul, on random GGUF rows of the 1.5B's MLP shapes.
Medians of 5. Run from the project root: ``python benchmarks/prefill_dense.py``."""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_q4_kernel import gguf_rows  # noqa: E402

from hf_adaspec.kernels import blocks, q4  # noqa: E402


def _ms(fn, n: int = 5) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[n // 2] * 1e3


def main() -> None:
    directory = Path("/tmp/q4-prefill-kernel")
    for name, k, n, gguf_type in [("gate_up", 1536, 17920, "Q4_K"), ("down", 8960, 1536, "Q6_K")]:
        kind, rows = gguf_rows(gguf_type, n, k, seed=1)
        args = (rows.reshape(-1), torch.tensor([blocks.KINDS.index(kind)], dtype=torch.int32), torch.tensor([n]), k,
                directory)
        weight = q4.dequantize_rows(kind, rows, k, torch.bfloat16, directory)  # [N, K]
        for m in (16, 32, 64, 128, 512):
            x = torch.randn(m, k).bfloat16()  # [M, K]
            kernel = _ms(lambda: q4.linear(x, *args))
            dequant = _ms(lambda: q4.dequantize_rows(kind, rows, k, torch.bfloat16, directory))
            matmul = _ms(lambda: torch.nn.functional.linear(x, weight))
            print(f"{name} M={m}: q4 {kernel:.1f} ms; dequantize {dequant:.1f} + bf16 matmul {matmul:.1f} ms")


if __name__ == "__main__":
    main()
