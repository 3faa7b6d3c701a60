"""``hf-adaspec replay``: price policies on greedy traces with the virtual clock, no model runs.

Design: the command is a thin shell over ``replay.report`` and ``replay.clock``; this module only turns options
into their inputs (the traces chosen by split, workload or a bench's prompts, the profiles, the controller's cost
table, the overheads fitted or given) and each bad input into a usage error naming the option and the fix; the
replay itself (controllers, clock, oracle, validation against a bench) lives in ``replay/``. Registered on the
CLI's app by ``cli``; the last stdout line is one JSON object. ``trace_cli`` takes the traces this command reads.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from .checks import check_output, usage_errors


def _bench_runs(bench: Path) -> list[dict]:
    """The runs of a bench JSON, or of ``benchmarks/llama_cpp_prompts.py --beside`` (a row per prompt, a column
    per method: made a run per method); a usage error of ``--bench`` when it is missing or neither."""
    fix = "give the JSON that `hf-adaspec bench --output` or `llama_cpp_prompts.py --beside` wrote"
    if not bench.is_file():
        raise typer.BadParameter(f"no file at {bench}; {fix}", param_hint="--bench")
    try:
        runs = json.loads(bench.read_text())["runs"]
        runs = (
            [
                {"question_id": r["question_id"], "method": m, "tokens_per_s": r[m]}
                for r in runs
                for m in ("plain", "adaptive")
                if m in r
            ]
            if runs and "method" not in runs[0]
            else runs
        )
        if not runs or not all({"question_id", "method", "tokens_per_s"} <= set(r) for r in runs):
            raise ValueError("its runs lack question_id, method or tokens_per_s")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise typer.BadParameter(f"{bench} is not a bench result ({e}); {fix}", param_hint="--bench") from None
    return runs


def _select(traces_dir: Path, split: str, workload: str, bench: Path | None) -> tuple[list, list[dict]]:
    """The traces to replay (the bench's prompts, in its order, when ``bench`` is given) and the bench's runs."""
    from ..bench.prompts import SPLITS
    from ..replay.trace import load_traces

    if split not in SPLITS:
        raise typer.BadParameter(f"{split!r}; choose one of {', '.join(SPLITS)}", param_hint="--split")
    if not traces_dir.is_dir():
        raise typer.BadParameter(
            f"no folder at {traces_dir}; take traces with `hf-adaspec trace --output "
            f"{traces_dir}`, or pass --traces (the repository's are in benchmarks/traces)",
            param_hint="--traces",
        )
    runs = _bench_runs(bench) if bench is not None else []
    with usage_errors(FileNotFoundError, ValueError, hint="--traces"):
        loaded = load_traces(traces_dir, list(dict.fromkeys(r["question_id"] for r in runs)) if runs else None)
    if runs:
        return loaded, runs
    chosen = [t for t in loaded if split in ("all", t.split) and workload in ("all", t.source)]
    if not chosen:
        raise typer.BadParameter(
            f"no traces in {traces_dir} for --split {split} --workload {workload}; the "
            f"workloads there: {', '.join(sorted({t.source for t in loaded}))}"
        )
    return chosen, []


def replay(
    traces: Path = typer.Option(Path("benchmarks/traces"), help="Directory of `hf-adaspec trace` files."),
    profile: Path = typer.Option(
        ...,
        help="Cost profile JSON (`hf-adaspec profile`); another machine's "
        "profile makes the output a projection for that machine.",
    ),
    methods: str = typer.Option(
        "plain,fixed-k,pmin,adaptive,adaptive-lookup",
        help="Comma-separated methods; "
        "fixed-head and adaptive-head draft with a head (traces from `hf-adaspec trace "
        "--head`, costs from --head-profile).",
    ),
    split: str = typer.Option("all", help="tune (even question ids) | held-out (odd) | all."),
    workload: str = typer.Option("all", help="Workload name the traces were taken with (e.g. spec_bench, code)."),
    batch_size: int = typer.Option(1, min=1, help="Rows per replayed request (static batches, in trace order)."),
    bench: Path | None = typer.Option(
        None,
        help="A bench JSON (or llama_cpp_prompts.py --beside's): replay its "
        "prompts in its order and report the error of each predicted speedup against "
        "the measured one.",
    ),
    controller_costs: Path | None = typer.Option(
        None,
        help="CostTable JSON the controller decides with (default: "
        "the profile, as the engine uses one); e.g. the calibration a bench "
        "ran with, from <cache>/costs/.",
    ),
    step_overhead_ms: float = typer.Option(0.0, help="Engine time per speculative step beyond the forwards (ms)."),
    plain_overhead_ms: float = typer.Option(0.0, help="transformers' time per plain step beyond the forward (ms)."),
    fit_overheads: bool = typer.Option(
        False,
        help="With --bench: fit both overheads on the bench's tune-split "
        "prompts (even ids) and report the errors on the held-out ones (odd).",
    ),
    output: Path = typer.Option(Path("benchmarks/results/replay.json"), help="JSON out; a .md table beside it."),
    head_profile: Path | None = typer.Option(
        None,
        help="A draft head's cost profile (`hf-adaspec profile --head "
        "FOLDER`, same target): prices the head methods and the head oracle.",
    ),
    prefill: str = typer.Option(
        "trace",
        help="trace: the prefill as the traces timed it; profile: priced by the "
        "profile (a projection onto another machine, e.g. a GPU's profile).",
    ),
    max_new_tokens: int | None = typer.Option(
        None,
        min=1,
        help="Replay each request asked for at most this many tokens (its trace's first ones; default: as traced).",
    ),
    plain: str = typer.Option(
        "profile",
        help="profile: plain decoding priced as the engine's forwards; trace: transformers' plain generate as the "
        "traces timed it (batch size 1, on the traces' machine: a bench's plain run there).",
    ),
) -> None:
    """Predict each method's tokens/s, speedup, accepted length, k and drafter histograms and % of oracle by
    replaying the library's controllers on traces (no model runs). Last stdout line: one JSON object."""
    from ..bench.summary import markdown, summarize, write_json

    start = time.perf_counter()
    method_list = _replay_methods(methods)
    if fit_overheads and (bench is None or batch_size != 1):
        raise typer.BadParameter("--fit-overheads needs --bench and batch size 1")
    check_output(output)
    loaded = _load_profile(profile)
    heads = _load_profile(head_profile, "--head-profile") if head_profile is not None else None
    chosen, bench_runs = _select(traces, split, workload, bench)
    if max_new_tokens is not None:
        chosen = [t.truncated(max_new_tokens) for t in chosen]
    table = _load_table(controller_costs) if controller_costs is not None else None
    costs_for = (lambda b, c: table) if table is not None else None
    if fit_overheads:
        step_overhead_ms, plain_overhead_ms = _fitted_overheads(
            chosen, method_list, (loaded, heads), costs_for, bench_runs
        )
    clock, result = _replayed(
        chosen,
        method_list,
        (loaded, heads),
        (step_overhead_ms, plain_overhead_ms),
        batch_size,
        costs_for,
        prefill,
        plain,
    )
    summary = summarize(result.runs, method_list, result.oracles)
    meta = {
        "kind": "replay prediction (virtual clock, not measured)",
        "profile": str(profile),
        "profile_machine": clock.profile.meta.get("cpu"),
        "traces": str(traces),
        "split": split,
        "workload": workload,
        "batch_size": batch_size,
        "methods": method_list,
        "prompts": len(chosen),
        "head_profile": str(head_profile) if head_profile else None,
        "controller_costs": str(controller_costs) if controller_costs else "profile",
        "step_overhead_ms": step_overhead_ms,
        "plain_overhead_ms": plain_overhead_ms,
        "prefill": prefill,
        "plain": plain,
        "max_new_tokens": max_new_tokens,
    }
    extra = {"oracles": result.oracles, "replays": [r.summary() for r in result.replays]}
    line = {
        "output": str(output),
        "prompts": len(chosen),
        "all_match_traces": all(r.matches_plain for r in result.runs),
        "predicted_speedup": {m: round(summary["table"]["overall"][m]["speedup"], 3) for m in method_list},
    }
    if bench_runs:
        meta["validation"], extra["validation"], errors = _validation(result.runs, bench_runs, fit_overheads, bench)
        line.update(errors, step_overhead_ms=round(step_overhead_ms, 2), plain_overhead_ms=round(plain_overhead_ms, 2))
    write_json(output, meta, summary, result.runs, **extra)
    output.with_suffix(".md").write_text(
        "Replay prediction (virtual clock from the profile, not measured)\n\n" + markdown(summary, method_list)
    )
    typer.echo(markdown(summary, method_list))
    line["seconds"] = round(time.perf_counter() - start, 1)
    typer.echo(json.dumps(line))


def _replay_methods(methods: str) -> list[str]:
    """The ``--methods`` list, plain first if it was left out; a usage error naming the replay's methods."""
    from ..replay.replay import REPLAY_METHODS

    method_list = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in method_list if m not in REPLAY_METHODS]
    if unknown:
        raise typer.BadParameter(
            f"unknown {', '.join(unknown)}; choose from {', '.join(REPLAY_METHODS)}", param_hint="--methods"
        )
    return method_list if "plain" in method_list else ["plain", *method_list]


def _fitted_overheads(chosen: list, methods: list[str], profiles: tuple, costs_for, bench_runs: list[dict]):
    """(step, plain) overheads in ms fitted on the bench's tune-split prompts (``replay.report.fit_overheads``);
    ``profiles``: (the cost profile, the head's or None)."""
    from ..replay.report import fit_overheads, replay_all

    with usage_errors(ValueError, hint="--bench"):
        unpriced = replay_all(chosen, methods, _clock(profiles, (0.0, 0.0)), 1, costs_for)
        return fit_overheads(unpriced.replays, bench_runs, {t.question_id for t in chosen if t.split == "tune"})


def _replayed(
    chosen: list,
    methods: list[str],
    profiles: tuple,
    overheads: tuple[float, float],
    batch_size: int,
    costs_for,
    prefill: str = "trace",
    plain: str = "profile",
):
    """(clock, ``replay_all``'s result); a usage error for methods the traces or profiles cannot replay, or for
    a plain run the traces cannot time."""
    from ..replay.report import replay_all

    clock = _clock(profiles, overheads, prefill, plain)
    with usage_errors(ValueError):  # e.g. a draft method on traces taken without a draft model
        return clock, replay_all(chosen, methods, clock, batch_size, costs_for)


def _clock(profiles: tuple, overheads: tuple[float, float], prefill: str = "trace", plain: str = "profile"):
    """The replay's ``Clock`` from (profile, head profile or None); a usage error of ``--head-profile`` for a
    head profile that is not one, or of another target, or of ``--prefill`` or ``--plain``."""
    from ..replay.clock import Clock

    with usage_errors(ValueError, hint="--head-profile, --prefill, --plain"):
        return Clock(profiles[0], *overheads, head_profile=profiles[1], prefill=prefill, plain=plain)


def _load_profile(path: Path, hint: str = "--profile"):
    from ..costs.profile_files import load_profile

    with usage_errors(ValueError, hint=hint):
        return load_profile(path)


def _load_table(path: Path):
    """A ``CostTable`` from its cached JSON (``costs.cache.read_table``: digest and values checked).
    Raises typer.BadParameter naming the file and the fix when it is missing or not one."""
    from ..costs.cache import TABLE_ERRORS, read_table

    try:
        return read_table(path)
    except TABLE_ERRORS as e:
        raise typer.BadParameter(
            f"{path} is not a cost table ({e}); give a JSON from <cache>/costs/, or leave "
            "--controller-costs out to decide with the profile",
            param_hint="--controller-costs",
        ) from None


def _validation(runs: list, bench_runs: list, fitted: bool, bench: Path | None) -> tuple[dict, list, dict]:
    """Each predicted speedup against the bench's measured one (``replay.report.validate``), on the held-out prompts
    (odd ids) where the overheads were ``fitted`` on the others: (the results' entry, the pairs, the last line's
    error fields). Raises typer.BadParameter (--bench) where they share no (prompt, method) beyond plain."""
    from ..replay.report import validate

    judged = [r for r in runs if not fitted or r.question_id % 2 == 1]
    with usage_errors(ValueError, hint="--bench"):
        check = validate(judged, bench_runs)
    entry = {
        "prompts": "held-out (odd ids)" if fitted else "all",
        "median_abs_error": check.median_abs_error,
        "p90_abs_error": check.p90_abs_error,
        "per_method": check.per_method,
        "bench": str(bench),
    }
    return (
        entry,
        check.pairs,
        {"median_abs_error": round(check.median_abs_error, 4), "p90_abs_error": round(check.p90_abs_error, 4)},
    )
