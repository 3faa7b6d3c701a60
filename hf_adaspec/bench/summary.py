"""The bench's results: per category and method the tokens/s, speedup vs plain, % of the oracle, acceptance and
k, as one summary dict; its markdown tables, its speedup plot, and the JSON of every run beside them.

Design: everything here is a pure function of the runs (``bench.Run``) and the prompts' oracles; nothing times or
runs a model, so the bench and ``hf-adaspec replay`` (whose predicted runs have the same shape) share one summary
and one report. Speedups are geometric means of per-prompt ratios against the prompt's plain run; a mean over
values that may be missing skips them (``–`` in the tables). Files are written through a temp file and a rename;
matplotlib is optional (no PNG without it).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, is_dataclass
from pathlib import Path

from .bench import Run
from .oracle_inputs import PromptOracle


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(kept) if kept else None


def _method_cell(rows: list[Run], plain: dict[int, float]) -> dict:
    """Median tokens/s, geometric-mean speedup vs plain, % of the oracle, mean acceptance and k."""
    bounded = [r.tokens_per_s / r.oracle_tokens_per_s for r in rows if r.oracle_tokens_per_s]
    return {
        "tokens_per_s": statistics.median([r.tokens_per_s for r in rows]),
        "speedup": _geomean([r.tokens_per_s / plain[r.question_id] for r in rows]),
        "pct_oracle": 100.0 * _geomean(bounded) if bounded else None,
        "acceptance": _mean([r.acceptance for r in rows]),
        "mean_k": _mean([r.mean_k for r in rows]),
    }


def _oracle_cell(oracles: list[PromptOracle], plain: dict[int, float]) -> dict:
    """Mean draft agreement and lookup hit rate, and each family's oracle speedup vs plain."""
    families = sorted({f for o in oracles for f in o.tokens_per_s})
    return {
        "draft_agreement": _mean([o.draft_agreement for o in oracles]),
        "lookup_hit_rate": _mean([o.lookup_agreement for o in oracles]),
        "oracle_speedup": {
            f: _geomean([o.tokens_per_s[f] / plain[o.question_id] for o in oracles if f in o.tokens_per_s])
            for f in families
        },
    }


def summarize(runs: list[Run], methods: list[str], oracles: list[PromptOracle] = ()) -> dict:
    """Per category and overall, per method: median tokens/s, geometric-mean speedup vs plain and % of
    the oracle (geometric mean of per-prompt ratios), mean acceptance and k; per category the
    oracle's agreement figures (see ``oracle_inputs``)."""
    plain = {r.question_id: r.tokens_per_s for r in runs if r.method == "plain"}
    table: dict[str, dict[str, dict]] = {}
    oracle_table: dict[str, dict] = {}
    for cat in sorted({r.category for r in runs}) + ["overall"]:
        rows = [r for r in runs if cat == "overall" or r.category == cat]
        table[cat] = {m: _method_cell([r for r in rows if r.method == m], plain) for m in methods}
        picked = [o for o in oracles if cat == "overall" or o.category == cat]
        if picked:
            oracle_table[cat] = _oracle_cell(picked, plain)
    mismatches = {m: sum(1 for r in runs if r.method == m and not r.matches_plain) for m in methods}
    gaps = {
        m: max((r.divergence_gap for r in runs if r.method == m and r.divergence_gap is not None), default=None)
        for m in methods
    }
    return {
        "table": table,
        "oracle": oracle_table,
        "greedy_mismatches": mismatches,
        "max_divergence_gap": gaps,
        "prompts": len(plain),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown(summary: dict, methods: list[str]) -> str:
    """Markdown tables per category and method: tokens/s (speedup vs plain); % of oracle; acceptance
    and mean k; then the oracle's draft agreement, lookup hit rate and oracle speedups."""
    head = "| category | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods) + "\n"
    speed = head + "".join(
        f"| {cat} | " + " | ".join(f"{row[m]['tokens_per_s']:.2f} ({row[m]['speedup']:.2f}x)" for m in methods) + " |\n"
        for cat, row in summary["table"].items()
    )
    spec = [m for m in methods if m != "plain"]
    head = "| category | " + " | ".join(spec) + " |\n|---|" + "---|" * len(spec) + "\n"
    pct = head + "".join(
        f"| {cat} | " + " | ".join(_fmt(row[m].get("pct_oracle"), ".0f") + "%" for m in spec) + " |\n"
        for cat, row in summary["table"].items()
    )
    acc = head + "".join(
        f"| {cat} | "
        + " | ".join(f"{_fmt(row[m].get('acceptance'), '.2f')} / {_fmt(row[m].get('mean_k'), '.2f')}" for m in spec)
        + " |\n"
        for cat, row in summary["table"].items()
    )
    text = f"tokens/s (speedup vs plain)\n\n{speed}\n% of oracle tokens/s\n\n{pct}\nacceptance / mean k\n\n{acc}"
    if summary.get("oracle"):
        fams = sorted({f for row in summary["oracle"].values() for f in row["oracle_speedup"]})
        text += (
            "\ndraft agreement, prompt-lookup hit rate, oracle speedup vs plain\n\n| category | draft agreement | "
            "lookup hit rate | "
            + " | ".join(f"oracle {f}" for f in fams)
            + " |\n|---|---|---|"
            + "---|" * len(fams)
            + "\n"
        )
        for cat, row in summary["oracle"].items():
            text += (
                f"| {cat} | {_fmt(row['draft_agreement'], '.2f')} | {_fmt(row['lookup_hit_rate'], '.2f')} | "
                + " | ".join(f"{row['oracle_speedup'].get(f, float('nan')):.2f}x" for f in fams)
                + " |\n"
            )
    return text


def plot(summary: dict, methods: list[str], path: Path) -> None:
    """PNG: speedup vs plain per category (grouped bars, one per method), 1.0 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats, spec = list(summary["table"]), [m for m in methods if m != "plain"]
    width = 0.8 / max(len(spec), 1)
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(cats) * max(len(spec), 1) * 0.35 + 4), 4.5))
    for i, m in enumerate(spec):
        xs = [c + (i - (len(spec) - 1) / 2) * width for c in range(len(cats))]
        ax.bar(xs, [summary["table"][c][m]["speedup"] for c in cats], width, label=m, color=f"C{i}")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats, rotation=30, ha="right")
    ax.set(ylabel="speedup vs plain (geometric mean)", title="Spec-Bench speedup per category")
    ax.legend(ncol=4, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def write_json(path: Path, meta: dict, summary: dict, runs: list, **extra: list) -> None:
    """``{"meta", "summary", "runs", **extra}`` as JSON, written atomically (temp file, then rename);
    runs and the lists in ``extra`` hold dataclasses (or JSON values)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    data = {"meta": meta, "summary": summary, "runs": [asdict(r) for r in runs]}
    data.update({k: [asdict(v) if is_dataclass(v) else v for v in values] for k, values in extra.items()})
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def write_results(path: Path, runs: list[Run], summary: dict, meta: dict, oracles: list[PromptOracle] = ()) -> None:
    """JSON with every run, every prompt's oracle, the summary and the run's settings; the markdown
    tables and the speedup PNG beside it."""
    write_json(path, meta, summary, runs, oracles=list(oracles))
    path.with_suffix(".md").write_text(markdown(summary, meta["methods"]))
    try:
        plot(summary, meta["methods"], path.with_suffix(".png"))
    except ImportError:
        print("hf-adaspec: no PNG written; pip install matplotlib (or the [notebooks] extra) for the plot")
