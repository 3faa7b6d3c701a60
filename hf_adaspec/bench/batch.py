"""Batch benchmark: plain batched generate vs fixed-k and adaptive static-batch speculation.

The same prompts run at every batch size B (split into chunks of B rows); within a chunk the methods
run interleaved, the order rotating from chunk to chunk. Each hf-adaspec method learns into a fresh
``SpeculationState`` per batch size, across that size's chunks, so no timed run starts from a state that
has seen its prompts (suffix drafting would recall the answers a smaller B produced). Reported per
(B, method): generated tokens/s over the batch (all rows' new tokens / wall time), mean per-request
latency (time until the row finished; the whole call for plain generate), mean batch-wide k, acceptance,
speedup vs plain at the same B (``plain-again``, plain timed a second time in the same rotation, is the
A/A control), and how many rows equal plain batched greedy. transformers' assisted
generation is tried and recorded as unsupported where it refuses the batch.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from ..api.generate_batch import encode_batch, generate_batch
from ..engine.run import SpeculationState
from .bench import divergence_gap
from .prompts import Prompt, load_prompts
from .summary import write_json

BATCH_METHODS = ("plain", "plain-again", "hf-assisted", "fixed-k", "adaptive")
NEEDS_DRAFT = ("hf-assisted", "fixed-k", "adaptive")  # batch methods that run the draft model
# generate_batch's speculation=; "plain-again" is plain timed twice, an A/A control: its speedup is the run's noise
_SPECULATION = {"plain": None, "plain-again": None, "fixed-k": "fixed", "adaptive": "adaptive"}


@dataclass(frozen=True)
class BatchRun:
    """One timed chunk of ``rows`` prompts with one method (error: why the method refused)."""

    batch_size: int
    method: str
    rows: int
    new_tokens: int
    seconds: float
    mean_latency_s: float
    mean_k: float | None = None
    acceptance: float | None = None
    rows_equal_plain: int | None = None
    max_divergence_gap: float | None = None
    error: str | None = None


def pick_prompts(path: Path, count: int) -> list[Prompt]:
    """``count`` Spec-Bench prompts taken round-robin over the categories (first prompts of each).

    Raises:
        FileNotFoundError: no such file (``load_prompts``).
        ValueError: the file has fewer than ``count`` prompts, naming the fix.
    """
    by_cat: dict[str, list[Prompt]] = {}
    for p in load_prompts(path, count):
        by_cat.setdefault(p.category, []).append(p)
    ordered = [b[i] for i in range(count) for b in by_cat.values() if i < len(b)]
    if len(ordered) < count:
        raise ValueError(
            f"{path} has only {len(ordered)} prompts to pick from, asked for {count}; lower "
            "--batch-prompts / the largest --batch-size, or pass --prompts to a larger file"
        )
    return ordered[:count]


def _run(model, tokenizer, draft, texts: list[str], method: str, cfg: dict, state: SpeculationState | None = None):
    """(sequences or None, stats or None, seconds, error) of one method on one chunk (greedy); an hf-adaspec
    method learns into ``state`` (None: a fresh one)."""
    start = time.perf_counter()
    if method == "hf-assisted":
        inputs = encode_batch(tokenizer, texts)
        try:
            out = model.generate(
                **inputs,
                assistant_model=draft,
                max_new_tokens=cfg["max_new_tokens"],
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
        except ValueError as err:
            return None, None, 0.0, str(err).splitlines()[0]
        return out, None, time.perf_counter() - start, None
    spec = _SPECULATION[method]
    extra = {"num_speculative_tokens": cfg["fixed_k"]} if spec == "fixed" else {}
    if spec is not None:
        extra["speculation_state"] = state if state is not None else SpeculationState()
    gen = generate_batch(
        model,
        tokenizer,
        texts,
        draft_model=draft if spec else None,
        speculation=spec,
        max_new_tokens=cfg["max_new_tokens"],
        **extra,
    )
    return gen.sequences, gen.stats, time.perf_counter() - start, None


def run_sizes(model, tokenizer, draft, prompts: list[Prompt], sizes: list[int], methods: list[str], cfg: dict):
    """Warm up at every size (calibrating each size's cost tables before anything is timed), then
    ``run_batch_size`` at each → list[BatchRun]. ``draft`` None: no draft model (the CLI then refuses the
    methods of ``NEEDS_DRAFT``)."""
    from tqdm.auto import tqdm

    for b in sizes:
        generate_batch(
            model,
            tokenizer,
            ["Say hello."] * b,
            draft_model=draft,
            max_new_tokens=4,
            speculation_state=SpeculationState(),
        )
    return [
        run
        for b in tqdm(sizes, desc="batch sizes")
        for run in run_batch_size(model, tokenizer, draft, prompts, b, methods, cfg)
    ]


def run_batch_size(model, tokenizer, draft, prompts: list[Prompt], batch: int, methods: list[str], cfg: dict):
    """Every method on every chunk of ``batch`` prompts, interleaved and rotated → list[BatchRun]. Each
    hf-adaspec method starts this batch size from a fresh ``SpeculationState`` and learns across its chunks
    (which hold distinct prompts), so no timed chunk meets an answer it already produced."""
    runs = []
    states = {m: SpeculationState() for m in methods if _SPECULATION.get(m)}
    for c, first in enumerate(range(0, len(prompts), batch)):
        texts = [p.text for p in prompts[first : first + batch]]
        prompt_len = encode_batch(tokenizer, texts)["input_ids"].shape[1]
        order = methods[c % len(methods) :] + methods[: c % len(methods)]
        results = {m: _run(model, tokenizer, draft, texts, m, cfg, states.get(m)) for m in order}
        plain = results["plain"][0]
        for m in methods:
            seq, stats, seconds, error = results[m]
            if error is not None:
                runs.append(BatchRun(batch, m, len(texts), 0, 0.0, 0.0, error=error))
                continue
            new = sum(int((row[prompt_len:] != tokenizer.pad_token_id).sum()) for row in seq)
            latency = stats.mean_latency_ms / 1000.0 if stats is not None else seconds
            gaps = [_row_gap(model, plain[i], seq[i], tokenizer.pad_token_id) for i in range(len(texts))]
            known = [g for g in gaps if g is not None]
            runs.append(
                BatchRun(
                    batch,
                    m,
                    len(texts),
                    new,
                    seconds,
                    latency,
                    stats.mean_k if stats else None,
                    stats.acceptance_rate if stats else None,
                    gaps.count(None),
                    max(known) if known else None,
                )
            )
    return runs


def overall_line(summary: dict, output: Path, prompts: int, methods: list[str]) -> dict:
    """The batch bench's last stdout line: speedups vs plain per batch size and the adaptive method's mean k."""
    table = summary["table"]
    return {
        "output": str(output),
        "prompts": prompts,
        "speedup_vs_plain": {
            b: {m: round(r["speedup"], 3) for m, r in row.items() if "speedup" in r} for b, row in table.items()
        },
        "mean_k": {
            b: {
                m: round(row[m]["mean_k"], 2)
                for m in ("adaptive",)
                if m in methods and row[m].get("mean_k") is not None
            }
            for b, row in table.items()
        },
    }


def _row_gap(model, plain, other, pad_id: int) -> float | None:
    """None if the rows are equal, else the target's top-2 logit gap where ``other`` first leaves plain
    (rows [T] with left and right padding stripped; a small gap is a near-tie, not a bug)."""

    def strip(row):
        real = (row != pad_id).nonzero().flatten()
        return row[int(real[0]) : int(real[-1]) + 1][None].to(model.device)

    if plain.tolist() == other.tolist():
        return None
    return divergence_gap(model, strip(plain), strip(other))


def summarize(runs: list[BatchRun], methods: list[str]) -> dict:
    """Per batch size and method: tokens/s, speedup vs plain, mean latency, mean k, acceptance, rows = plain."""
    table: dict[int, dict[str, dict]] = {}
    for batch in sorted({r.batch_size for r in runs}):
        rows = [r for r in runs if r.batch_size == batch]
        plain_rate = sum(r.new_tokens for r in rows if r.method == "plain") / sum(
            r.seconds for r in rows if r.method == "plain"
        )
        table[batch] = {}
        for m in methods:
            mine = [r for r in rows if r.method == m]
            if any(r.error for r in mine):
                table[batch][m] = {"unsupported": next(r.error for r in mine if r.error)}
                continue
            rate = sum(r.new_tokens for r in mine) / sum(r.seconds for r in mine)
            ks = [r.mean_k for r in mine if r.mean_k is not None]
            acc = [r.acceptance for r in mine if r.acceptance is not None and r.acceptance == r.acceptance]
            table[batch][m] = {
                "tokens_per_s": rate,
                "speedup": rate / plain_rate,
                "mean_latency_s": statistics.fmean(r.mean_latency_s for r in mine),
                "mean_k": statistics.fmean(ks) if ks else None,
                "acceptance": statistics.fmean(acc) if acc else None,
                "rows_equal_plain": sum(r.rows_equal_plain or 0 for r in mine),
                "rows": sum(r.rows for r in mine),
                "max_divergence_gap": max(
                    (r.max_divergence_gap for r in mine if r.max_divergence_gap is not None), default=None
                ),
            }
    return {"table": table}


def markdown(summary: dict, methods: list[str]) -> str:
    """Markdown: per batch size, tokens/s (speedup), mean latency and mean k per method."""
    head = "| B | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods) + "\n"
    body = ""
    for batch, row in summary["table"].items():
        cells = []
        for m in methods:
            r = row[m]
            if "unsupported" in r:
                cells.append("unsupported")
                continue
            k = f", k̄ {r['mean_k']:.2f}" if r["mean_k"] is not None else ""
            cells.append(f"{r['tokens_per_s']:.1f} tok/s ({r['speedup']:.2f}x), {r['mean_latency_s']:.1f} s{k}")
        body += f"| {batch} | " + " | ".join(cells) + " |\n"
    return head + body


def plot(summary: dict, methods: list[str], path: Path) -> None:
    """PNG: tokens/s vs batch size per method, and the adaptive method's mean k vs batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = {int(b): row for b, row in summary["table"].items()}  # JSON keys are strings
    sizes = sorted(table)
    colours = {m: f"C{i}" for i, m in enumerate(methods)}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for m in methods:
        pts = [(b, table[b][m]["tokens_per_s"]) for b in sizes if "unsupported" not in table[b][m]]
        ax1.plot([b for b, _ in pts], [v for _, v in pts], marker="o", label=m, color=colours[m])
    ax1.set(xscale="log", xlabel="batch size B", ylabel="generated tokens/s (whole batch)", title="Throughput")
    ax1.set_xticks(sizes, [str(b) for b in sizes])
    ax1.legend()
    for m in [m for m in methods if m in ("adaptive", "fixed-k")]:
        ax2.plot(sizes, [table[b][m].get("mean_k") or 0.0 for b in sizes], marker="o", label=m, color=colours[m])
    ax2.set(xscale="log", xlabel="batch size B", ylabel="mean batch-wide k per step", title="Chosen k")
    ax2.set_xticks(sizes, [str(b) for b in sizes])
    ax2.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_results(path: Path, runs: list[BatchRun], summary: dict, meta: dict) -> None:
    """JSON (every run, summary, settings) written atomically; markdown table and PNG beside it."""
    write_json(path, meta, summary, runs)
    path.with_suffix(".md").write_text(markdown(summary, meta["methods"]))
    try:
        plot(summary, meta["methods"], path.with_suffix(".png"))
    except ImportError:
        print("hf-adaspec: no PNG written; pip install matplotlib (or the [notebooks] extra) for the plot")
