"""One MLP projection (8960 → 1536, the 1.5B target's down_proj) over 1, 2, 5 and 9 rows, bf16 activations, in each
weight kernel this machine runs: bitsandbytes NF4, our q4 kernel (``hf_adaspec.kernels.q4``), torch's int4
(``_weight_int4pack_mm_for_cpu``, group 32, min–max), torch's int8 (``_weight_int8pack_mm``), dense bf16 and
fp32. Medians of 30 calls, formats interleaved per repetition, ms. Run it plainly and under the AVX2 reproduction
(``PYTHONPATH=benchmarks/avx2 ATEN_CPU_CAPABILITY=avx2``) to compare the paths. Last line: one JSON object."""

import json
import statistics
import time

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import torch

from hf_adaspec.kernels import q4
from hf_adaspec.models.assets import cache_dir


def _torch_int4(w: torch.Tensor, group: int = 32):
    """w [N, K] → (packed codes, scales-and-zeros [K/group, N, 2] bf16) for ``_weight_int4pack_mm_for_cpu``."""
    g = w.reshape(-1, group)
    lo, hi = g.amin(1, keepdim=True), g.amax(1, keepdim=True)
    scale = (hi - lo).clamp(min=1e-6) / 15
    codes = (g - lo).div(scale).round().clamp(0, 15).to(torch.int32).reshape_as(w)
    zeros = lo + scale * 8
    sz = torch.cat([scale.reshape(w.shape[0], -1, 1), zeros.reshape(w.shape[0], -1, 1)], 2).transpose(0, 1)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), sz.contiguous().to(torch.bfloat16)


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(1536, 8960) * 0.02  # [N, K]
    lin = bnb.nn.Linear4bit(8960, 1536, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(w.to(torch.bfloat16), requires_grad=False, quant_type="nf4")
    lin = lin.to("cpu")
    int4, int4_sz = _torch_int4(w)
    blocks, kernels_dir = q4.pack(w), cache_dir() / "kernels"
    scale = w.abs().amax(1) / 127
    int8 = (w / scale[:, None]).round().to(torch.int8)
    wb = w.to(torch.bfloat16)
    kernels = {
        "nf4": lambda x: lin(x),
        "q4": lambda x: q4.linear(x, blocks, 1536, kernels_dir),
        "int4": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4, 32, int4_sz),
        "int8": lambda x: torch._weight_int8pack_mm(x, int8, scale.to(torch.bfloat16)),
        "bf16": lambda x: x @ wb.t(),
        "fp32": lambda x: x.float() @ w.t(),
    }
    out = {"capability": torch.backends.cpu.get_cpu_capability(), "bnb_avx512bf16": bool(bnbf.has_avx512bf16()),
           "threads": torch.get_num_threads(), "ms": {}}
    for rows in (1, 2, 5, 9):
        x = torch.randn(rows, 8960).to(torch.bfloat16)
        times = {k: [] for k in kernels}
        with torch.inference_mode():
            for f in kernels.values():
                f(x)
            for _ in range(30):
                for name, f in kernels.items():
                    t = time.perf_counter()
                    f(x)
                    times[name].append((time.perf_counter() - t) * 1e3)
        out["ms"][rows] = {k: round(statistics.median(v), 3) for k, v in times.items()}
        print(rows, out["ms"][rows], flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
