"""Benchmark: plain vs transformers' assisted generation / prompt lookup vs fixed-k vs adaptive.

"hf-assisted" is transformers' assisted generation with its defaults, which already stop drafting
once the assistant's token probability falls below ``assistant_confidence_threshold=0.4`` (the
transformers confidence baseline; with scikit-learn installed transformers re-tunes that threshold
online from an ROC curve of draft probability vs. match; without it the threshold stays fixed).
"confidence" is AdaSpec's calibrated confidence-prior stopping (arXiv 2503.05096); "pmin" the
llama.cpp-style baseline that stops drafting at a draft probability < 0.75. A "-fit" method is its
namesake priced by the profile's fitted line for every quantity (the pooled predictor choice that
per-quantity scoring replaced, ``profile``), an in-run ablation.

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
from .bench_oracle import PromptOracle, prompt_oracle
from .cost_tracking import CostScale
from .integration import SpeculationState

METHODS = ("plain", "hf-assisted", "hf-prompt-lookup", "fixed-k", "adaptive", "adaptive-lookup", "hybrid",
           "confidence", "confidence-target", "pmin", "adaptive-sofar", "hybrid-sofar", "confidence-sofar",
           "adaptive-mean", "hybrid-mean", "hybrid-confidence", "plain-again", "confidence-hedged",
           "hybrid-confidence-hedged", "adaptive-fit", "confidence-fit", "adaptive-lookup-fit", "hybrid-fit",
           "hybrid-confidence-fit", "confidence-recal", "hybrid-confidence-recal", "adaptive-noprefix",
           "confidence-noprefix", "hybrid-confidence-noprefix", "adaptive-lookup-hindsight", "hybrid-hindsight",
           "hybrid-confidence-hindsight")

# which oracle bounds a method: the drafters it may use (plain has none)
METHOD_FAMILY = {"hf-assisted": "draft", "hf-prompt-lookup": "lookup", "fixed-k": "draft", "adaptive": "draft",
                 "adaptive-lookup": "lookup", "hybrid": "hybrid", "confidence": "draft", "confidence-target": "draft",
                 "pmin": "draft", "adaptive-sofar": "draft", "hybrid-sofar": "hybrid", "confidence-sofar": "draft",
                 "adaptive-mean": "draft", "hybrid-mean": "hybrid", "hybrid-confidence": "hybrid",
                 "confidence-hedged": "draft", "hybrid-confidence-hedged": "hybrid", "confidence-fit": "draft",
                 "adaptive-lookup-fit": "lookup", "hybrid-confidence-fit": "hybrid", "adaptive-fit": "draft",
                 "hybrid-fit": "hybrid", "confidence-recal": "draft", "hybrid-confidence-recal": "hybrid",
                 "adaptive-noprefix": "draft", "confidence-noprefix": "draft", "hybrid-confidence-noprefix": "hybrid",
                 "adaptive-lookup-hindsight": "lookup", "hybrid-hindsight": "hybrid",
                 "hybrid-confidence-hindsight": "hybrid"}


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
    acceptance: float | None = None
    mean_k: float | None = None
    oracle_tokens_per_s: float | None = None
    realized_oracle_tokens_per_s: float | None = None
    cost_scale: CostScale | None = None
    draft_prefix_tokens: int | None = None


@dataclass(frozen=True)
class PromptResult:
    """Every method's run on one prompt, and the prompt's oracle (None without a cost table)."""

    runs: list[Run]
    oracle: PromptOracle | None = None


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


def method_kwargs(method: str, draft, fixed_k: int, adapt_costs: bool = False, target_confidence: bool = False
                  ) -> dict:
    """generate() keyword arguments for one method (all greedy). For the goodput and confidence methods,
    ``adapt_costs``: correct measured costs online (``cost_tracking``); ``target_confidence``: learn
    from the target's confidence on steps without the draft (``target_confidence``)."""
    table = {
        "plain": {},
        "hf-assisted": {"assistant_model": draft},
        "hf-prompt-lookup": {"prompt_lookup_num_tokens": 10},
        "fixed-k": {"assistant_model": draft, "speculation": "fixed", "num_speculative_tokens": fixed_k},
        "adaptive": {"assistant_model": draft, "speculation": "adaptive"},
        "adaptive-lookup": {"speculation": "adaptive"},
        "hybrid": {"assistant_model": draft, "speculation": "hybrid"},
        "confidence": {"assistant_model": draft, "speculation": "confidence"},
        "confidence-target": {"assistant_model": draft, "speculation": "confidence", "target_confidence": True},
        "pmin": {"assistant_model": draft, "speculation": "pmin", "draft_p_min": 0.75},
        "hybrid-confidence": {"assistant_model": draft, "speculation": "hybrid-confidence"},
        "plain-again": {},  # an A/A control: plain decoding timed again, its speedup is the run's noise
    }
    for mode in ("adaptive", "hybrid", "confidence"):  # the horizon ablation: catch-up amortised over tokens so far
        table[f"{mode}-sofar"] = {**table[mode], "learn_horizon": False}
    for mode in ("confidence", "hybrid-confidence"):  # the hedged horizon: the lower quartile of remaining lengths
        table[f"{mode}-hedged"] = {**table[mode], "horizon_quantile": 0.25}
    for mode in ("adaptive", "confidence", "adaptive-lookup", "hybrid", "hybrid-confidence"):  # predictor ablation
        table[f"{mode}-fit"] = dict(table[mode])
    for mode in ("confidence", "hybrid-confidence"):  # per-request recalibration of the confidence calibration
        table[f"{mode}-recal"] = {**table[mode], "recalibrate": True}
    for mode in ("adaptive", "confidence", "hybrid-confidence"):  # the draft's prompt catch-up from scratch
        table[f"{mode}-noprefix"] = {**table[mode], "reuse_draft_prefix": False}
    for mode in ("adaptive-lookup", "hybrid", "hybrid-confidence"):  # lookup also scored on unverified steps
        table[f"{mode}-hindsight"] = {**table[mode], "lookup_hindsight": True}
    for mode in ("adaptive", "hybrid"):  # the α-prior ablation: each request starts at the running mean
        table[f"{mode}-mean"] = {**table[mode], "alpha_prior_quantile": None}
    if method not in table:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    kwargs = dict(table[method])
    if kwargs.get("speculation") in ("adaptive", "hybrid", "confidence", "hybrid-confidence"):
        kwargs.update({"adapt_costs": True} if adapt_costs else {})
        kwargs.update({"target_confidence": True} if target_confidence else {})
    return kwargs


def fit_cost_table(cfg: dict, context: int):
    """The cost table a "-fit" method runs with: the pair's profile at ``context`` tokens with every quantity
    from the fitted line (``cfg["fit_costs"]``), as one pooled predictor chose before per-quantity scoring.

    Raises:
        ValueError: no profile (``cfg["fit_costs"]`` None or missing); names the command that measures one.
    """
    if cfg.get("fit_costs") is None:
        raise ValueError("the -fit methods need the pair's cost profile; measure one with `hf-adaspec profile`")
    return cfg["fit_costs"](context)


def _timed(generate: Callable[..., object], inputs: dict, kwargs: dict, max_new_tokens: int):
    start = time.perf_counter()
    out = generate(**inputs, **kwargs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
    return out, time.perf_counter() - start


def run_prompt(model, tokenizer, draft, prompt: Prompt, methods: list[str], rotation: int, cfg: dict) -> PromptResult:
    """Run every method ``cfg["repeats"]`` times on one prompt, in rotated order (median time);
    compare outputs with plain; with ``cfg["costs"]`` (context tokens → the controller's CostTable) also
    the oracle. With ``cfg["states"]`` (a dict) each hf-adaspec method learns into its own
    ``SpeculationState``, created there on first use, as if it were the only method a user ran."""
    msgs = [{"role": "user", "content": prompt.text}]
    inputs = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_len = inputs["input_ids"].shape[1]
    order = methods[rotation % len(methods):] + methods[: rotation % len(methods)]
    outputs: dict[str, tuple] = {}
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    for _ in range(cfg.get("repeats", 1)):  # every method once per round: drift hits all alike
        for method in order:
            kwargs = method_kwargs(method, draft, cfg["fixed_k"], cfg.get("adapt_costs", False),
                                   cfg.get("target_confidence", False))
            if "speculation" in kwargs and "states" in cfg:
                kwargs["speculation_state"] = cfg["states"].setdefault(method, SpeculationState())
            if method.endswith("-fit"):
                kwargs["speculation_costs"] = fit_cost_table(cfg, prompt_len)
            outputs[method] = _timed(model.generate, inputs, kwargs, cfg["max_new_tokens"])
            seconds[method].append(outputs[method][1])
    plain_seq = outputs["plain"][0].sequences if "plain" in outputs else None
    scales = {m: getattr(getattr(out, "speculation", None), "cost_scale", None) for m, (out, _) in outputs.items()}
    reused = [getattr(getattr(out, "speculation", None), "draft_prefix_tokens", 0) for out, _ in outputs.values()]
    oracle = None
    if plain_seq is not None and cfg.get("costs") is not None:  # the draft's catch-up less the best reused prefix
        oracle = prompt_oracle(model, draft, plain_seq, prompt_len, cfg["costs"](prompt_len), cfg.get("k_max", 8),
                               (prompt.question_id, prompt.category), median_scale(scales), max(reused))
    runs = []
    for method in methods:
        out, elapsed = outputs[method][0], statistics.median(seconds[method])
        new = out.sequences.shape[1] - prompt_len
        stats = getattr(out, "speculation", None)
        gap = divergence_gap(model, plain_seq, out.sequences) if plain_seq is not None else None
        family = METHOD_FAMILY.get(method)
        bound = oracle.tokens_per_s.get(family) if oracle is not None and family else None
        realized = (oracle.realized_tokens_per_s or {}).get(family) if oracle is not None and family else None
        runs.append(Run(prompt.question_id, prompt.category, method, new, elapsed, new / elapsed,
                        plain_seq is not None and gap is None,
                        stats.mean_accepted_length if stats else None, stats.plain_share if stats else None,
                        gap, stats.acceptance_rate if stats else None, stats.mean_k if stats else None, bound,
                        realized, scales.get(method), getattr(stats, "draft_prefix_tokens", None)))
    return PromptResult(runs, oracle)


def median_scale(scales: dict[str, CostScale | None]) -> CostScale | None:
    """Median verify and draft-model ratios over the methods that measured them (``cost_tracking``; the
    draft ratio from the methods whose first drafter is the draft model); None when none did."""
    kept = {m: s for m, s in scales.items() if s is not None}
    drafts = [s.draft[0] for m, s in kept.items() if METHOD_FAMILY.get(m) in ("draft", "hybrid") and s.draft]
    if not kept:
        return None
    return CostScale(statistics.median(s.verify for s in kept.values()), (statistics.median(drafts or [1.0]),))


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


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.fmean(kept) if kept else None


def _method_cell(rows: list[Run], plain: dict[int, float]) -> dict:
    """Median tokens/s, geometric-mean speedup vs plain, % of the oracle (profile costs, and the costs
    the runs realized), mean acceptance and k, median cost-correction ratios."""
    bounded = [r.tokens_per_s / r.oracle_tokens_per_s for r in rows if r.oracle_tokens_per_s]
    realized = [r.tokens_per_s / r.realized_oracle_tokens_per_s for r in rows if r.realized_oracle_tokens_per_s]
    return {
        "tokens_per_s": statistics.median([r.tokens_per_s for r in rows]),
        "speedup": _geomean([r.tokens_per_s / plain[r.question_id] for r in rows]),
        "pct_oracle": 100.0 * _geomean(bounded) if bounded else None,
        "pct_oracle_realized": 100.0 * _geomean(realized) if realized else None,
        "acceptance": _mean([r.acceptance for r in rows]),
        "mean_k": _mean([r.mean_k for r in rows]),
        "cost_scale": _median_ratios([r.cost_scale for r in rows if r.cost_scale is not None]),
    }


def _median_ratios(scales: list[CostScale]) -> dict | None:
    """Median realized / predicted verify and first-drafter ratios of the runs that measured them."""
    if not scales:
        return None
    return {"verify": statistics.median(s.verify for s in scales),
            "draft": statistics.median(s.draft[0] if s.draft else 1.0 for s in scales)}


def _oracle_cell(oracles: list[PromptOracle], plain: dict[int, float]) -> dict:
    """Mean draft agreement and lookup hit rate, and each family's oracle speedup vs plain."""
    families = sorted({f for o in oracles for f in o.tokens_per_s})
    return {
        "draft_agreement": _mean([o.draft_agreement for o in oracles]),
        "lookup_hit_rate": _mean([o.lookup_agreement for o in oracles]),
        "oracle_speedup": {f: _geomean([o.tokens_per_s[f] / plain[o.question_id] for o in oracles
                                        if f in o.tokens_per_s]) for f in families},
    }


def summarize(runs: list[Run], methods: list[str], oracles: list[PromptOracle] = ()) -> dict:
    """Per category and overall, per method: median tokens/s, geometric-mean speedup vs plain and % of
    the oracle (geometric mean of per-prompt ratios), mean acceptance and k; per category the
    oracle's agreement figures (see ``bench_oracle``)."""
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
    gaps = {m: max((r.divergence_gap for r in runs if r.method == m and r.divergence_gap is not None),
                   default=None) for m in methods}
    return {"table": table, "oracle": oracle_table, "greedy_mismatches": mismatches, "max_divergence_gap": gaps,
            "prompts": len(plain)}


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def markdown(summary: dict, methods: list[str]) -> str:
    """Markdown tables per category and method: tokens/s (speedup vs plain); % of oracle; acceptance
    and mean k; then the oracle's draft agreement, lookup hit rate and oracle speedups."""
    head = "| category | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods) + "\n"
    speed = head + "".join(
        f"| {cat} | " + " | ".join(f"{row[m]['tokens_per_s']:.2f} ({row[m]['speedup']:.2f}x)" for m in methods) + " |\n"
        for cat, row in summary["table"].items())
    spec = [m for m in methods if m != "plain"]
    head = "| category | " + " | ".join(spec) + " |\n|---|" + "---|" * len(spec) + "\n"
    pct = head + "".join(f"| {cat} | " + " | ".join(_fmt(row[m].get("pct_oracle"), ".0f") + "%" for m in spec) + " |\n"
                         for cat, row in summary["table"].items())
    pct_realized = head + "".join(
        f"| {cat} | " + " | ".join(_fmt(row[m].get("pct_oracle_realized"), ".0f") + "%" for m in spec) + " |\n"
        for cat, row in summary["table"].items())
    acc = head + "".join(
        f"| {cat} | " + " | ".join(f"{_fmt(row[m].get('acceptance'), '.2f')} / {_fmt(row[m].get('mean_k'), '.2f')}"
                                   for m in spec) + " |\n" for cat, row in summary["table"].items())
    text = (f"tokens/s (speedup vs plain)\n\n{speed}\n% of oracle tokens/s\n\n{pct}\n% of oracle tokens/s, "
            f"oracle at the costs the runs realized\n\n{pct_realized}\nacceptance / mean k\n\n{acc}")
    if summary.get("oracle"):
        fams = sorted({f for row in summary["oracle"].values() for f in row["oracle_speedup"]})
        text += ("\ndraft agreement, prompt-lookup hit rate, oracle speedup vs plain\n\n| category | draft agreement | "
                 "lookup hit rate | " + " | ".join(f"oracle {f}" for f in fams) + " |\n|---|---|---|"
                 + "---|" * len(fams) + "\n")
        for cat, row in summary["oracle"].items():
            text += (f"| {cat} | {_fmt(row['draft_agreement'], '.2f')} | {_fmt(row['lookup_hit_rate'], '.2f')} | "
                     + " | ".join(f"{row['oracle_speedup'].get(f, float('nan')):.2f}x" for f in fams) + " |\n")
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
    runs and the lists in ``extra`` hold dataclasses."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    data = {"meta": meta, "summary": summary, "runs": [asdict(r) for r in runs]}
    data.update({k: [asdict(v) for v in values] for k, values in extra.items()})
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
