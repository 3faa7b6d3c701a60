"""hf-adaspec beside llama.cpp on this machine: the demo prompt, greedy, 256 new tokens (issue 44).

Loads the default pair as ``hf-adaspec generate`` does (``--quantization``, default "auto": the formats it chose
are printed), then times plain, plain again (the A/A spread) and ``adaptive``, interleaved, ``--repeats``
rounds, after one short ``adaptive`` run on another prompt (a pair's first use calibrates its step costs: a
one-time cost per machine, cached, kept out of the timed rounds); every ``adaptive`` run starts from a fresh
``SpeculationState`` (nothing learned from this prompt); each
method's last output is checked against plain's (``greedy_gap_vs_plain``: null when equal, else the target's top-2
logit gap where it first differs: a near-tie when small).
Tokens/s over wall time, prefill included; medians. The llama.cpp figures are read from the JSON that
``../shared/tools/llama_cpp_anchor.sh`` wrote on the same machine (same ISA): plain and speculative tokens/s
on the same prompt and length (its own timing: decoding only). With ``--llama-cpp-bin`` (that script's build
folder) llama.cpp's plain decoding also runs in every round, in the rotation with ours (``llama_cpp_prompts``'s
timing: prefill included, like ours): a machine whose speed drifts during the run shifts both sides alike, and
``interleaved`` gives the ratios from those runs. Usage, from the project root:

    ISA=native ../shared/tools/llama_cpp_anchor.sh benchmarks/results/llama_cpp_anchor_native.json
    python benchmarks/side_by_side.py --anchor benchmarks/results/llama_cpp_anchor_native.json \\
        --llama-cpp-bin ~/.cache/llama-cpp-anchor/build-native/bin
    # the AVX2 path reproduced on an AVX512 CPU (benchmarks/avx2/sitecustomize.py):
    ISA=avx2 ../shared/tools/llama_cpp_anchor.sh benchmarks/results/llama_cpp_anchor_avx2.json
    PYTHONPATH=benchmarks/avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/side_by_side.py \\
        --anchor benchmarks/results/llama_cpp_anchor_avx2.json --llama-cpp-bin ~/.cache/llama-cpp-anchor/build-avx2/bin

Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from llama_cpp_prompts import _gguf, _plain  # benchmarks/, on sys.path when this script runs

from hf_adaspec import SpeculationState
from hf_adaspec.bench.bench import divergence_gap
from hf_adaspec.cli.cli import DEFAULT_PROMPT
from hf_adaspec.cli.pair import load_pair
from hf_adaspec.machine import processor_name


def _timed_rates(
    tgt, drf, repeats: int, max_new_tokens: int, llama_bin: Path | None
) -> tuple[dict[str, list[float]], dict[str, float | None]]:
    """Tokens/s per method and round (``llama.cpp`` too where ``llama_bin`` is given), and each of our methods'
    greedy check against plain (``divergence_gap`` of its last output: None when equal, else the target's top-2
    logit gap where it first differs)."""
    messages = [{"role": "user", "content": DEFAULT_PROMPT}]
    inputs = tgt.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    methods = {"plain": {}, "plain-again": {}, "adaptive": {"assistant_model": drf.model, "speculation": "adaptive"}}
    names = list(methods) + (["llama.cpp"] if llama_bin else [])
    text = tgt.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    gguf = _gguf("qwen2.5-coder-1.5b") if llama_bin else None
    rates: dict[str, list[float]] = {m: [] for m in names}
    outputs: dict[str, torch.Tensor] = {}
    for rnd in range(repeats):
        for name in names[rnd % len(names) :] + names[: rnd % len(names)]:  # rotated: drift hits every method alike
            if name == "llama.cpp":
                rates[name].append(round(_plain(llama_bin, gguf, text, max_new_tokens, torch.get_num_threads()), 3))
                print(f"{name}: {rates[name][-1]:.2f} tokens/s", flush=True)
                continue
            kwargs = dict(methods[name])
            if "speculation" in kwargs:
                kwargs["speculation_state"] = SpeculationState()
            start = time.perf_counter()
            out = tgt.model.generate(**inputs, **kwargs, max_new_tokens=max_new_tokens, do_sample=False)
            rates[name].append(round((out.shape[1] - inputs["input_ids"].shape[1]) / (time.perf_counter() - start), 3))
            outputs[name] = out
            print(f"{name}: {rates[name][-1]:.2f} tokens/s", flush=True)
    return rates, {m: divergence_gap(tgt.model, outputs["plain"], outputs[m]) for m in methods if m != "plain"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--anchor", required=True, type=Path, help="llama_cpp_anchor.sh's JSON from this machine")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--llama-cpp-bin", type=Path, help="llama.cpp's bin folder: its plain decoding in every round")
    args = ap.parse_args()
    anchor = json.loads(args.anchor.read_text())
    tgt, drf = load_pair("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", args.quantization, "bfloat16")
    warm = tgt.tokenizer("Say hello.", return_tensors="pt")  # another prompt: a first use's cost calibration
    tgt.model.generate(
        **warm,
        assistant_model=drf.model,
        speculation="adaptive",
        max_new_tokens=8,
        do_sample=False,
        speculation_state=SpeculationState(),
    )
    rates, gaps = _timed_rates(tgt, drf, args.repeats, args.max_new_tokens, args.llama_cpp_bin)
    med = {m: round(statistics.median(v), 2) for m, v in rates.items()}
    llama = anchor["plain_tokens_per_s"]
    interleaved = (
        None
        if args.llama_cpp_bin is None
        else {
            "llama_cpp_plain": med["llama.cpp"],
            "bin": str(args.llama_cpp_bin),
            "plain_over_llama_cpp_plain": round(med["plain"] / med["llama.cpp"], 3),
            "adaptive_over_llama_cpp_plain": round(med["adaptive"] / med["llama.cpp"], 3),
        }
    )
    print(
        json.dumps(
            {
                "processor": processor_name(),
                "aten_cpu": torch.backends.cpu.get_cpu_capability(),
                "threads": torch.get_num_threads(),
                "formats": {"target": tgt.format_label, "draft": drf.format_label},
                "tokens_per_s": med,
                "aa": round(med["plain-again"] / med["plain"], 3),
                "llama_cpp": {"isa": anchor["isa"], "plain": llama, "speculative": anchor["speculative_tokens_per_s"]},
                "adaptive_over_llama_cpp_plain": round(med["adaptive"] / llama, 3),
                "plain_ms_per_token_over_llama_cpp": round(llama / med["plain"], 2),
                "interleaved": interleaved,
                "greedy_gap_vs_plain": gaps,
                "runs": rates,
            }
        )
    )


if __name__ == "__main__":
    main()
