"""``hf-adaspec trace`` and ``hf-adaspec replay``: take greedy traces, then price policies on them.

Registered on the CLI's app by ``cli``; each command's last stdout line is one JSON object.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from tqdm.auto import tqdm

from ..files import sweep
from ..models.presets import DEFAULT_DRAFT, DEFAULT_TARGET
from .pair import load_pair
from .prompts import PACKAGED_PER_CATEGORY, SPEC_BENCH, Prompt, load_prompts
from .trace import load_trace, save_trace, take_trace, trace_path

# shown in --help instead of the packaged file's site-packages path
SPEC_BENCH_SHOWN = f"packaged Spec-Bench subset, {PACKAGED_PER_CATEGORY} prompts per category"


def interleave_categories(prompts: list[Prompt]) -> list[Prompt]:
    """The first prompt of every category, then the second of each, …: a partial run covers them all."""
    rank: dict[str, int] = {}
    keyed = []
    for p in prompts:
        rank[p.category] = rank.get(p.category, -1) + 1
        keyed.append((rank[p.category], len(keyed), p))
    return [p for _, _, p in sorted(keyed, key=lambda t: t[:2])]


def _done(directory: Path, prompt: Prompt, max_new_tokens: int, names: tuple[str, str]) -> bool:
    """A finished trace of this prompt, length and pair is already there (a resumed run skips it)."""
    path = trace_path(directory, prompt.question_id)
    if not path.is_file():
        return False
    try:
        t = load_trace(path)
    except ValueError:
        return False
    return (t.max_new_tokens, t.target, t.draft) == (max_new_tokens, *names)


def trace(
    prompts: Path = typer.Option(SPEC_BENCH, help="Spec-Bench style JSONL (question_id, category, turns).",
                                 show_default=SPEC_BENCH_SHOWN),
    per_category: int = typer.Option(8, min=1, help="Prompts per category (the first ones of each)."),
    max_new_tokens: int = typer.Option(256, min=1),
    output: Path = typer.Option(Path("benchmarks/traces"), help="Directory: one <question_id>.json per prompt."),
    target: str = typer.Option(DEFAULT_TARGET),
    draft: str = typer.Option(DEFAULT_DRAFT, help="Draft model, or 'none' (traces for prompt lookup only)."),
    quantization: str = typer.Option("nf4"),
    dtype: str = typer.Option("bfloat16"),
    workload: str = typer.Option("", help="Workload name stored in each trace (default: the prompts file's stem)."),
) -> None:
    """Per prompt: the target's plain greedy output and the draft's argmax and q(x) along it (one teacher-forced
    pass), for ``replay``. Resumable: prompts already traced with the same pair and length are skipped, and
    what an interrupted run left half-written is removed."""
    sweep(output)
    try:
        selected = interleave_categories(load_prompts(prompts, per_category))
    except FileNotFoundError as e:
        raise typer.BadParameter(str(e), param_hint="--prompts") from None
    names = (target, "" if draft == "none" else draft)
    todo = [p for p in selected if not _done(output, p, max_new_tokens, names)]
    start = time.perf_counter()
    if todo:
        tgt, drf = load_pair(target, draft, quantization, dtype)
        for p in tqdm(todo, desc="trace prompts"):
            t = take_trace(tgt.model, tgt.tokenizer, drf.model if drf is not None else None, p, max_new_tokens,
                           names, source=workload or prompts.stem)
            save_trace(t, output)
    typer.echo(json.dumps({"output": str(output), "prompts": len(selected), "traced_now": len(todo),
                           "seconds": round(time.perf_counter() - start, 1)}))


def _select(traces_dir: Path, split: str, workload: str, bench: Path | None) -> tuple[list, list[dict]]:
    """The traces to replay (the bench's prompts, in its order, when ``bench`` is given) and the bench's runs."""
    from .trace import load_traces

    if bench is not None:
        runs = json.loads(bench.read_text())["runs"]
        ids = list(dict.fromkeys(r["question_id"] for r in runs))
        return load_traces(traces_dir, ids), runs
    chosen = [t for t in load_traces(traces_dir) if split in ("all", t.split) and workload in ("all", t.source)]
    if not chosen:
        raise typer.BadParameter(f"no traces in {traces_dir} for --split {split} --workload {workload}")
    return chosen, []


def replay(
    traces: Path = typer.Option(Path("benchmarks/traces"), help="Directory of `hf-adaspec trace` files."),
    profile: Path = typer.Option(..., help="Cost profile JSON (`hf-adaspec profile`); another machine's "
                                 "profile makes the output a projection for that machine."),
    methods: str = typer.Option("plain,fixed-k,pmin,adaptive,adaptive-lookup", help="Comma-separated methods."),
    split: str = typer.Option("all", help="tune (even question ids) | held-out (odd) | all."),
    workload: str = typer.Option("all", help="Workload name the traces were taken with (e.g. spec_bench, code)."),
    batch_size: int = typer.Option(1, min=1, help="Rows per replayed request (static batches, in trace order)."),
    bench: Path | None = typer.Option(None, help="A bench JSON: replay its prompts in its order and report the "
                                      "error of each predicted speedup against the measured one."),
    controller_costs: Path | None = typer.Option(None, help="CostTable JSON the controller decides with (default: "
                                                 "the profile, as the engine uses one); e.g. the calibration a bench "
                                                 "ran with, from <cache>/costs/."),
    step_overhead_ms: float = typer.Option(0.0, help="Engine time per speculative step beyond the forwards (ms)."),
    plain_overhead_ms: float = typer.Option(0.0, help="transformers' time per plain step beyond the forward (ms)."),
    fit_overheads: bool = typer.Option(False, help="With --bench: fit both overheads on the bench's tune-split "
                                       "prompts (even ids) and report the errors on the held-out ones (odd)."),
    output: Path = typer.Option(Path("benchmarks/results/replay.json"), help="JSON out; a .md table beside it."),
) -> None:
    """Predict each method's tokens/s, speedup, accepted length, k and drafter histograms and % of oracle by
    replaying the library's controllers on traces (no model runs). Last stdout line: one JSON object."""
    from . import bench as bm
    from .replay import Clock
    from .replay_report import fit_overheads as fit
    from .replay_report import replay_all, validate

    start = time.perf_counter()
    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    if "plain" not in method_list:
        method_list.insert(0, "plain")
    chosen, bench_runs = _select(traces, split, workload, bench)
    costs_for = None
    if controller_costs is not None:
        table = _load_table(controller_costs)
        costs_for = lambda b, c: table  # noqa: E731
    loaded = _load_profile(profile)
    if fit_overheads:
        if not bench_runs or batch_size != 1:
            raise typer.BadParameter("--fit-overheads needs --bench and batch size 1")
        unpriced = replay_all(chosen, method_list, Clock(loaded), 1, costs_for)
        step_overhead_ms, plain_overhead_ms = fit(unpriced.replays, bench_runs,
                                                  {t.question_id for t in chosen if t.split == "tune"})
    clock = Clock(loaded, step_overhead_ms, plain_overhead_ms)
    result = replay_all(chosen, method_list, clock, batch_size, costs_for)
    summary = bm.summarize(result.runs, method_list, result.oracles)
    meta = {"kind": "replay prediction (virtual clock, not measured)", "profile": str(profile),
            "profile_machine": clock.profile.meta.get("cpu"), "traces": str(traces), "split": split,
            "workload": workload, "batch_size": batch_size, "methods": method_list, "prompts": len(chosen),
            "controller_costs": str(controller_costs) if controller_costs else "profile",
            "step_overhead_ms": step_overhead_ms, "plain_overhead_ms": plain_overhead_ms}
    extra = {"oracles": result.oracles, "replays": [r.summary() for r in result.replays]}
    line = {"output": str(output), "prompts": len(chosen), "all_match_traces": all(r.matches_plain for r in result.runs),
            "predicted_speedup": {m: round(summary["table"]["overall"][m]["speedup"], 3) for m in method_list}}
    if bench_runs:
        judged = [r for r in result.runs if not fit_overheads or r.question_id % 2 == 1]  # held-out when fitted
        check = validate(judged, bench_runs)
        meta["validation"] = {"prompts": "held-out (odd ids)" if fit_overheads else "all",
                              "median_abs_error": check.median_abs_error, "p90_abs_error": check.p90_abs_error,
                              "per_method": check.per_method, "bench": str(bench)}
        extra["validation"] = check.pairs
        line.update(median_abs_error=round(check.median_abs_error, 4), p90_abs_error=round(check.p90_abs_error, 4),
                    step_overhead_ms=round(step_overhead_ms, 2), plain_overhead_ms=round(plain_overhead_ms, 2))
    bm.write_json(output, meta, summary, result.runs, **extra)
    output.with_suffix(".md").write_text("Replay prediction (virtual clock from the profile, not measured)\n\n"
                                         + bm.markdown(summary, method_list))
    typer.echo(bm.markdown(summary, method_list))
    line["seconds"] = round(time.perf_counter() - start, 1)
    typer.echo(json.dumps(line))


def _load_profile(path: Path):
    from ..costs.profile import load_profile

    try:
        return load_profile(path)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _load_table(path: Path):
    """A ``CostTable`` from its cached JSON. Raises typer.BadParameter naming the file when unreadable."""
    from ..costs.table import CostTable

    try:
        data = json.loads(path.read_text())
        return CostTable(**{**data, "verify_ms": tuple(data["verify_ms"])})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise typer.BadParameter(f"{path}: not a cost table ({e})") from None
