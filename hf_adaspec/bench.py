"""Benchmark: plain vs transformers' assisted generation / prompt lookup vs fixed-k vs adaptive.

Methods run interleaved per prompt (the order rotates from prompt to prompt) so machine drift hits
every method alike; each run is greedy, so every method's output is also checked against plain.
Reported per category: tokens/s (new tokens over wall time, prefill included) and speedup vs plain
(geometric mean of per-prompt ratios); overall: geometric mean over all prompts.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import hf_compat

METHODS = ("plain", "hf-assisted", "hf-prompt-lookup", "fixed-k", "adaptive", "adaptive-lookup", "hybrid")


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: Spec-Bench id, category and the first user turn."""

    question_id: int
    category: str
    text: str


@dataclass(frozen=True)
class Run:
    """One timed generation: tokens/s over wall time, and whether it equals plain greedy."""

    question_id: int
    category: str
    method: str
    new_tokens: int
    seconds: float
    tokens_per_s: float
    matches_plain: bool
    mean_accepted_length: float | None = None
    plain_share: float | None = None
    divergence_gap: float | None = None


def load_prompts(path: Path, per_category: int, categories: list[str] | None = None) -> list[Prompt]:
    """First ``per_category`` prompts of each category from a Spec-Bench style JSONL (first turn).

    Raises:
        FileNotFoundError: no such file (Spec-Bench lives at ../shared/data/spec_bench/question.jsonl).
    """
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}; pass --prompts PATH to a Spec-Bench JSONL")
    taken: dict[str, list[Prompt]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        cat = row["category"]
        if categories and cat not in categories:
            continue
        bucket = taken.setdefault(cat, [])
        if len(bucket) < per_category:
            bucket.append(Prompt(int(row["question_id"]), cat, row["turns"][0]))
    return [p for bucket in taken.values() for p in bucket]


def method_kwargs(method: str, draft, fixed_k: int) -> dict:
    """generate() keyword arguments for one method (all greedy)."""
    table = {
        "plain": {},
        "hf-assisted": {"assistant_model": draft},
        "hf-prompt-lookup": {"prompt_lookup_num_tokens": 10},
        "fixed-k": {"assistant_model": draft, "speculation": "fixed", "num_speculative_tokens": fixed_k},
        "adaptive": {"assistant_model": draft, "speculation": "adaptive"},
        "adaptive-lookup": {"speculation": "adaptive"},
        "hybrid": {"assistant_model": draft, "speculation": "hybrid"},
    }
    if method not in table:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    return table[method]


def _timed(generate: Callable[..., object], inputs: dict, kwargs: dict, max_new_tokens: int):
    start = time.perf_counter()
    out = generate(**inputs, **kwargs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
    return out, time.perf_counter() - start


def run_prompt(model, tokenizer, draft, prompt: Prompt, methods: list[str], rotation: int, cfg: dict) -> list[Run]:
    """Run every method ``cfg["repeats"]`` times on one prompt, in rotated order (median time);
    compare outputs with plain."""
    msgs = [{"role": "user", "content": prompt.text}]
    inputs = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = inputs["input_ids"].shape[1]
    order = methods[rotation % len(methods):] + methods[: rotation % len(methods)]
    outputs: dict[str, tuple] = {}
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(cfg.get("repeats", 1)):  # every method once per round: drift hits all alike
        for method in order:
            kwargs = method_kwargs(method, draft, cfg["fixed_k"])
            outputs[method] = _timed(model.generate, inputs, kwargs, cfg["max_new_tokens"])
            seconds[method].append(outputs[method][1])
    plain_seq = outputs["plain"][0].sequences if "plain" in outputs else None
    runs = []
    for method in methods:
        out, elapsed = outputs[method][0], statistics.median(seconds[method])
        new = out.sequences.shape[1] - prompt_len
        stats = getattr(out, "speculation", None)
        gap = divergence_gap(model, plain_seq, out.sequences) if plain_seq is not None else None
        runs.append(Run(prompt.question_id, prompt.category, method, new, elapsed, new / elapsed,
                        plain_seq is not None and gap is None,
                        stats.mean_accepted_length if stats else None, stats.plain_share if stats else None,
                        gap))
    return runs


def divergence_gap(model, plain: torch.Tensor, other: torch.Tensor) -> float | None:
    """Where ``other`` [1, T'] first differs from ``plain`` [1, T], the target's top-1 minus top-2
    logit after the common prefix (a near-tie when small); None if neither differs; inf when one is a
    strict prefix of the other (never a near-tie)."""
    n = min(plain.shape[1], other.shape[1])
    diff = (plain[0, :n] != other[0, :n]).nonzero()
    if not diff.numel():
        return None if plain.shape[1] == other.shape[1] else float("inf")
    with torch.no_grad():
        cache = hf_compat.new_cache(model)
        logits = hf_compat.forward_logits(model, plain[:, : int(diff[0])], cache, keep=1)[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def summarize(runs: list[Run], methods: list[str]) -> dict:
    """Per category and overall: median tokens/s and geometric-mean speedup vs plain."""
    plain = {r.question_id: r.tokens_per_s for r in runs if r.method == "plain"}
    cats = sorted({r.category for r in runs})
    table: dict[str, dict[str, dict[str, float]]] = {}
    for cat in cats + ["overall"]:
        rows = [r for r in runs if cat == "overall" or r.category == cat]
        table[cat] = {
            m: {
                "tokens_per_s": statistics.median([r.tokens_per_s for r in rows if r.method == m]),
                "speedup": _geomean([r.tokens_per_s / plain[r.question_id] for r in rows if r.method == m]),
            }
            for m in methods
        }
    mismatches = {m: sum(1 for r in runs if r.method == m and not r.matches_plain) for m in methods}
    gaps = {m: max((r.divergence_gap for r in runs if r.method == m and r.divergence_gap is not None),
                   default=None) for m in methods}
    return {"table": table, "greedy_mismatches": mismatches, "max_divergence_gap": gaps, "prompts": len(plain)}


def markdown(summary: dict, methods: list[str]) -> str:
    """Markdown table: tokens/s and (speedup vs plain) per category and method."""
    head = "| category | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods) + "\n"
    body = ""
    for cat, row in summary["table"].items():
        cells = [f"{row[m]['tokens_per_s']:.2f} ({row[m]['speedup']:.2f}x)" for m in methods]
        body += f"| {cat} | " + " | ".join(cells) + " |\n"
    return head + body


def write_json(path: Path, meta: dict, summary: dict, runs: list) -> None:
    """``{"meta", "summary", "runs"}`` as JSON, written atomically (temp file, then rename); runs are
    dataclasses."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"meta": meta, "summary": summary, "runs": [asdict(r) for r in runs]}, indent=2))
    tmp.replace(path)


def write_results(path: Path, runs: list[Run], summary: dict, meta: dict) -> None:
    """JSON with every run, the summary and the run's settings; markdown table beside it."""
    write_json(path, meta, summary, runs)
    path.with_suffix(".md").write_text(markdown(summary, meta["methods"]))
