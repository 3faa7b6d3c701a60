"""One MLP projection (8960 → 1536, the 1.5B target's down_proj) over 1, 2, 5 and 9 rows, bf16 activations, in each
weight kernel this machine runs: bitsandbytes NF4, torch's int4 (``_weight_int4pack_mm_for_cpu`` via torchao's
opaque int4 tensor, group 32), torch's int8 (``_weight_int8pack_mm``), dense bf16 and fp32. Medians of 30 calls,
formats interleaved per repetition, ms. Run it plainly and under the AVX2 reproduction
(``PYTHONPATH=benchmarks/avx2 ATEN_CPU_CAPABILITY=avx2``) to compare the paths. Last line: one JSON object."""

import json
import statistics
import time

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import torch
from torchao.prototype.quantization.int4 import Int4OpaqueTensor


def main() -> None:
    torch.manual_seed(0)
    w = torch.randn(1536, 8960) * 0.02  # [N, K]
    lin = bnb.nn.Linear4bit(8960, 1536, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
    lin.weight = bnb.nn.Params4bit(w.to(torch.bfloat16), requires_grad=False, quant_type="nf4")
    lin = lin.to("cpu")
    int4 = Int4OpaqueTensor.from_hp(w.to(torch.bfloat16), [1, 32])
    scale = w.abs().amax(1) / 127
    int8 = (w / scale[:, None]).round().to(torch.int8)
    wb = w.to(torch.bfloat16)
    kernels = {
        "nf4": lambda x: lin(x),
        "int4": lambda x: torch.nn.functional.linear(x, int4),
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
