"""Replay over a set of traces: every method in order with its own learned state, the oracle per prompt,
the bench's summary tables, and the check of predicted against measured speedups (``validate``). A draft
head's methods are bounded by the oracle's head families (``replay.HEAD_FAMILY``).

The replayed runs are reported as ``bench.Run`` records (seconds = predicted time), so the bench's summary
and markdown apply unchanged; every figure is labelled a prediction (a projection when the profile was
measured on another machine).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backend.draft_prefix import DraftPrefixStore
from ..bench.bench import METHOD_FAMILY, PromptOracle, Run
from ..engine.run import SpeculationState
from .clock import Clock
from .replay import (
    HEAD_FAMILY,
    ReplayRun,
    VirtualDraft,
    check_head_method,
    oracle_tokens_per_s,
    replay_request,
)
from .trace import Trace
from .virtual import VirtualHead


@dataclass(frozen=True)
class ReplayResult:
    """Every replayed request and every prompt's oracle, as the bench reports them, plus the histograms."""

    runs: list[Run]
    oracles: list[PromptOracle]
    replays: list[ReplayRun]


def replay_all(
    traces: Sequence[Trace], methods: Sequence[str], clock: Clock, batch_size: int = 1, costs_for=None
) -> ReplayResult:
    """Replay each method over ``traces`` in order (requests of ``batch_size`` rows), learning across them
    (a head method through one ``VirtualHead`` per method); at batch size 1 also each prompt's oracle
    (seeded like the draft's prefix store). Raises ValueError, before any replay, for a head method the
    traces or the clock cannot serve (``replay.check_head_method``)."""
    for m in methods:
        check_head_method(m, traces, clock)
    groups = [list(traces[i : i + batch_size]) for i in range(0, len(traces), batch_size)]
    replays = [
        replay_request(g, m, state, clock, costs_for, head)
        for m in methods
        for state, head in [(SpeculationState(), VirtualHead())]
        for g in groups
    ]
    oracles = _oracles(traces, clock) if batch_size == 1 else []
    bound = {o.question_id: o.tokens_per_s for o in oracles}
    runs = []
    for r in replays:
        per_row = r.time_ms / 1000.0
        for qid, cat in zip(r.question_ids, r.categories, strict=True):
            tokens = r.new_tokens if len(r.question_ids) == 1 else r.new_tokens / len(r.question_ids)
            family = METHOD_FAMILY.get(r.method) or HEAD_FAMILY.get(r.method)
            runs.append(
                Run(
                    qid,
                    cat,
                    r.method,
                    int(tokens),
                    per_row,
                    tokens / per_row,
                    r.matches_trace,
                    r.mean_accepted_length,
                    r.plain_share,
                    None,
                    r.acceptance,
                    r.mean_k,
                    bound.get(qid, {}).get(family) if family else None,
                    r.draft_prefix_tokens,
                )
            )
    return ReplayResult(runs, oracles, replays)


def _oracles(traces: Sequence[Trace], clock: Clock) -> list[PromptOracle]:
    """Per prompt the oracle tokens/s per family, the draft's catch-up less the prefix a store of the last 4
    prompts would seed; the draft's and the head's first-token agreement."""
    prefixes, out = DraftPrefixStore(), []
    for t in traces:
        seed = prefixes.seed(VirtualDraft, torch.tensor(list(t.tokens[: t.prompt_len]))).length
        prefixes.remember(VirtualDraft, t.tokens, len(t.tokens), seed, None)
        n = t.new_tokens
        agree, head = t.draft_agreement(), t.head_agreement()
        out.append(
            PromptOracle(
                t.question_id,
                t.category,
                n,
                t.prefill_ms,
                sum(agree) / len(agree) if agree else math.nan,
                math.nan,
                oracle_tokens_per_s(t, clock, seed),
                sum(head) / len(head) if head else math.nan,
            )
        )
    return out


@dataclass(frozen=True)
class Validation:
    """Predicted vs measured speedup over plain per (prompt, method): errors = predicted / measured − 1."""

    pairs: list[dict]
    median_abs_error: float
    p90_abs_error: float
    per_method: dict[str, dict[str, float]]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))] if ordered else math.nan


def validate(replayed: Sequence[Run], measured: Sequence[dict]) -> Validation:
    """Compare replayed runs with a bench's runs (its JSON "runs") on the prompts and methods both have.

    Raises ValueError when they share no (prompt, method) beyond plain."""
    bench_plain = {r["question_id"]: r["tokens_per_s"] for r in measured if r["method"] == "plain"}
    ours_plain = {r.question_id: r.tokens_per_s for r in replayed if r.method == "plain"}
    bench = {(r["question_id"], r["method"]): r for r in measured}
    pairs = []
    for r in replayed:
        b = bench.get((r.question_id, r.method))
        if r.method == "plain" or b is None or r.question_id not in bench_plain:
            continue
        predicted, actual = r.tokens_per_s / ours_plain[r.question_id], b["tokens_per_s"] / bench_plain[r.question_id]
        pairs.append(
            {
                "question_id": r.question_id,
                "category": r.category,
                "method": r.method,
                "predicted_speedup": predicted,
                "measured_speedup": actual,
                "error": predicted / actual - 1.0,
                "predicted_accepted_length": r.mean_accepted_length,
                "measured_accepted_length": b.get("mean_accepted_length"),
            }
        )
    if not pairs:
        raise ValueError(
            "the replay and the bench share no prompt and method besides plain; replay the bench's "
            "prompts (its question ids are taken when --bench is given)"
        )
    errors = [abs(p["error"]) for p in pairs]
    per_method = {
        m: {
            "median_abs_error": statistics.median(e),
            "p90_abs_error": _quantile(e, 0.9),
            "mean_error": statistics.fmean(s),
        }
        for m in sorted({p["method"] for p in pairs})
        for e in [[abs(p["error"]) for p in pairs if p["method"] == m]]
        for s in [[p["error"] for p in pairs if p["method"] == m]]
    }
    return Validation(pairs, statistics.median(errors), _quantile(errors, 0.9), per_method)


def fit_overheads(replays: Sequence[ReplayRun], measured: Sequence[dict], ids: set[int]) -> tuple[float, float]:
    """(step_overhead_ms, plain_overhead_ms): the median over the bench's runs of prompts ``ids`` of
    (measured − predicted ms) per step, speculative methods and plain apart; ``replays`` priced without
    overheads. Fit on one half of the prompts and judge the errors on the other."""
    bench = {(r["question_id"], r["method"]): r for r in measured}
    spec, plain = [], []
    for r in replays:
        qid = r.question_ids[0]
        b = bench.get((qid, r.method))
        if len(r.question_ids) != 1 or qid not in ids or b is None or not r.steps:
            continue
        (plain if r.method == "plain" else spec).append((1000.0 * b["seconds"] - r.time_ms) / r.steps)
    if not spec or not plain:
        raise ValueError("fitting overheads needs the bench's plain and speculative runs of the fitted prompts")
    return statistics.median(spec), statistics.median(plain)
