"""A cheaper target step (issue 26 item 4): which quantized CPU path runs the target's forward fastest
while staying faithful to the dense model?

Design: one candidate at a time is held beside the bitsandbytes NF4 model (the current default), so at
most two models are in memory. For each candidate we time forwards over n ∈ {1, 4, 8} new tokens on
top of synthetic contexts of 128 and 512 positions (``hf_compat.synthetic_cache`` +
``costs.table.time_forward_ms``, which rolls the cache back): warm-up rounds, then ``--rounds`` rounds
in which candidate and NF4 alternate at every (context, n), medians. The CPU is shared, so each
candidate is reported with the NF4 medians taken in the same rounds and the ratio to them; NF4's own
medians across phases are the A/A check. Faithfulness: greedy continuations (``--new-tokens`` tokens)
of the first turns of ``--prompts`` Spec-Bench questions under the chat template, compared with the
dense bf16 model's (the first phase): share of prompts identical and mean first-divergence position
(a prompt that agrees throughout counts as ``--new-tokens``). Memory: process RSS growth over the
candidate's load (approximate: allocator reuse). A ``+compile`` candidate wraps ``model.forward`` in
``torch.compile(dynamic=True)``; its compile time is the wall time of the first call at every shape.
A candidate that fails to load or run is recorded with its error and skipped; one whose 1-token
forward is over ``--hopeless`` times NF4's gets 3 timed rounds and no agreement check.

Candidates: nf4, bnb_int8, bf16 (hf_adaspec.load quantization nf4|int8|none); ao_int8wo, ao_int4wo,
ao_da8w8, ao_da8w4 (torchao through ``TorchAoConfig`` in from_pretrained, bf16, output head dense);
torch_dyn_int8 (``torch.ao.quantization.quantize_dynamic`` of the decoder's Linear layers, float32).

Run: .venv/bin/python benchmarks/target_step.py [--candidates bf16,bnb_int8,...] [--rounds 9]
Writes benchmarks/results/target_step.json; last stdout line: one JSON object (the same summary).
"""

import argparse
import gc
import json
import os
import statistics
import time
import warnings
from pathlib import Path

import psutil
import torch
import transformers

import hf_adaspec
from hf_adaspec.costs.table import time_forward_ms
from hf_adaspec.files import atomic_write
from hf_adaspec.models.loading import resolve
from hf_adaspec.backend import hf_compat

MODEL = "qwen2.5-coder-1.5b"
CONTEXTS = (128, 512)
WIDTHS = (1, 4, 8)
DEFAULT = "bf16,ao_int4wo,bnb_int8,torch_dyn_int8,ao_int8wo,ao_da8w8,ao_da8w4"
OUT = Path(__file__).parent / "results" / "target_step.json"


def _torchao_config(name: str):
    """The torchao config object behind a candidate name (imported lazily: torchao is optional)."""
    import torchao.quantization as q
    from torchao.prototype.quantization.int4.inference_workflow import (
        Int8DynamicActivationInt4WeightConfig, PrototypeInt4WeightOnlyConfig)

    return {"ao_int8wo": lambda: q.Int8WeightOnlyConfig(),
            "ao_int4wo": lambda: PrototypeInt4WeightOnlyConfig(group_size=128),
            "ao_da8w8": lambda: q.Int8DynamicActivationInt8WeightConfig(),
            "ao_da8w4": lambda: Int8DynamicActivationInt4WeightConfig()}[name]()


def load_candidate(name: str) -> torch.nn.Module:
    """The target under candidate ``name`` (without any ``+compile`` suffix), in eval mode."""
    bnb = {"nf4": "nf4", "bnb_int8": "int8", "bf16": "none"}
    if name in bnb:
        return hf_adaspec.load(MODEL, quantization=bnb[name]).model
    source = resolve(MODEL)
    if name == "ao_da8w4" and "CPU" not in torch._C._dispatch_dump("torchao::da8w4_linear_cpu"):
        raise RuntimeError("torchao's da8w4_linear_cpu kernel is not in this torchao build (PyPI wheel)")
    if name == "torch_dyn_int8":
        model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
        model.model = torch.ao.quantization.quantize_dynamic(model.model, {torch.nn.Linear}, dtype=torch.qint8)
        return model
    config = transformers.TorchAoConfig(_torchao_config(name))
    return transformers.AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.bfloat16, device_map="cpu", quantization_config=config).eval()


class Probe:
    """Synthetic caches of each context for one model and the token ids timed on top of them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.ids = torch.randint(0, 1000, (1, max(WIDTHS)), generator=torch.Generator().manual_seed(0))
        self.caches = {c: hf_compat.synthetic_cache(model, 1, c) for c in CONTEXTS}

    def time_ms(self, context: int, n: int) -> float:
        """Wall ms of one forward over ``n`` new tokens on the ``context`` cache (rolled back)."""
        return time_forward_ms(self.model, self.ids[:, :n], self.caches[context], keep=n)


def compile_forward(model: torch.nn.Module, probe: Probe) -> float:
    """Wrap ``model.forward`` in torch.compile and call it once at every timed shape; seconds taken."""
    model.forward = torch.compile(model.forward, dynamic=True)
    start = time.perf_counter()
    for context in CONTEXTS:
        for n in WIDTHS:
            probe.time_ms(context, n)
    return time.perf_counter() - start


def time_pair(cand: Probe, ref: Probe, rounds: int, warmup: int) -> dict:
    """Medians (ms) of candidate and NF4 per context and width, the two alternating in every round."""
    shapes = [(c, n) for c in CONTEXTS for n in WIDTHS]
    samples = {(who, c, n): [] for who in ("cand", "nf4") for c, n in shapes}
    for r in range(warmup + rounds):
        for c, n in shapes:
            first, second = (cand, ref) if r % 2 == 0 else (ref, cand)  # alternate who goes first
            for probe in (first, second):
                t = probe.time_ms(c, n)
                if r >= warmup:
                    samples[("cand" if probe is cand else "nf4", c, n)].append(t)
    out = {}
    for c, n in shapes:
        cand_ms, nf4_ms = (statistics.median(samples[(w, c, n)]) for w in ("cand", "nf4"))
        out[f"ctx{c}_n{n}"] = {"ms": round(cand_ms, 1), "nf4_ms": round(nf4_ms, 1),
                               "ratio_to_nf4": round(cand_ms / nf4_ms, 3)}
    return out


def prompts(path: str, count: int, tokenizer) -> list[dict]:
    """Chat-template inputs of the first turn of the first ``count`` questions in ``path``."""
    with open(path) as f:
        texts = [json.loads(line)["turns"][0] for line in f if line.strip()][:count]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True) for t in texts]


@torch.no_grad()
def greedy(model: torch.nn.Module, inputs: list[dict], new_tokens: int) -> list[list[int]]:
    """Greedy continuations (token ids, at most ``new_tokens``) of every input."""
    outs = []
    for x in inputs:
        seq = model.generate(**x, max_new_tokens=new_tokens, do_sample=False, pad_token_id=model.config.eos_token_id)
        outs.append(seq[0, x["input_ids"].shape[1]:].tolist())
    return outs


def agreement(outs: list[list[int]], refs: list[list[int]], new_tokens: int) -> dict:
    """Share of continuations identical to the reference and mean first-divergence position."""
    firsts = []
    for out, ref in zip(outs, refs):
        first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        firsts.append(new_tokens if out == ref else first)
    return {"identical_share": round(sum(o == r for o, r in zip(outs, refs)) / len(refs), 3),
            "mean_first_divergence": round(statistics.mean(firsts), 1), "first_divergence": firsts}


def _version(package: str) -> str | None:
    """An installed package's version, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def rss_gb() -> float:
    """This process's resident set size in GB, after a garbage collection."""
    gc.collect()
    return psutil.Process(os.getpid()).memory_info().rss / 1e9


def run_candidate(name: str, nf4: Probe, inputs: list[dict], refs: list[list[int]] | None, args) -> dict:
    """Load, (compile), time against NF4 and check greedy agreement for one candidate."""
    base, compiled = name.removesuffix("+compile"), name.endswith("+compile")
    before, start = rss_gb(), time.perf_counter()
    model = load_candidate(base)
    row = {"load_s": round(time.perf_counter() - start, 1), "rss_growth_gb": round(rss_gb() - before, 2),
           "load_avg_1min": os.getloadavg()[0]}
    probe = Probe(model)
    if compiled:
        row["compile_s"] = round(compile_forward(model, probe), 1)
    probe.time_ms(CONTEXTS[0], 1)
    ratio = probe.time_ms(CONTEXTS[0], 1) / nf4.time_ms(CONTEXTS[0], 1)
    hopeless = ratio > args.hopeless
    row["timing"] = time_pair(probe, nf4, 3 if hopeless else args.rounds, args.warmup)
    if hopeless:  # minutes of greedy decoding for a path that cannot replace NF4
        row["agreement_with_bf16"] = f"skipped: 1-token forward {ratio:.1f}x NF4's (> --hopeless)"
        return row, None
    outs = greedy(model, inputs, args.new_tokens)
    row["agreement_with_bf16"] = agreement(outs, refs if refs is not None else outs, args.new_tokens)
    row["load_avg_1min_after"] = os.getloadavg()[0]
    return row, outs


def safe_run(name: str, nf4: Probe, inputs: list[dict], refs, args) -> tuple[dict, list | None]:
    """``run_candidate``, or the error it raised (type and first line) and no continuations."""
    try:
        return run_candidate(name, nf4, inputs, refs, args)
    except Exception as e:  # a candidate that cannot load or run is a result, not a crash
        return {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"}, None
    finally:
        gc.collect()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--candidates", default=DEFAULT, help="comma-separated; bf16 always runs first")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--hopeless", type=float, default=3.0,
                    help="a candidate whose 1-token forward is over this many times NF4's gets 3 rounds, no agreement")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    transformers.utils.logging.disable_progress_bar()
    names = ["bf16"] + [c for c in args.candidates.split(",") if c and c != "bf16"]
    nf4 = hf_adaspec.load(MODEL, quantization="nf4")
    inputs = prompts(args.questions, args.prompts, nf4.tokenizer)
    nf4_probe = Probe(nf4.model)
    results, refs = {}, None
    for name in names:
        results[name], outs = safe_run(name, nf4_probe, inputs, refs, args)
        refs = outs if name == "bf16" else refs
        print(json.dumps({name: results[name]}), flush=True)
    if refs is not None:
        results["nf4"] = {"agreement_with_bf16": agreement(greedy(nf4.model, inputs, args.new_tokens), refs,
                                                           args.new_tokens)}
    summary = {"model": MODEL, "torch": torch.__version__, "transformers": transformers.__version__,
               "torchao": _version("torchao"), "bitsandbytes": _version("bitsandbytes"),
               "threads": torch.get_num_threads(), "contexts": CONTEXTS, "widths": WIDTHS,
               "rounds": args.rounds, "prompts": args.prompts, "new_tokens": args.new_tokens,
               "candidates": results}
    text = json.dumps(summary)
    atomic_write(Path(args.out), lambda f: f.write(text.encode()))
    print(text)


if __name__ == "__main__":
    main()
