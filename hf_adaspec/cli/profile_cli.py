"""``hf-adaspec profile``: measure a pair's cost profile (target forwards over new tokens × batch × context,
and the drafter's token and ingest), or a target with an EAGLE-3 draft head. Registered on the CLI's app by
``cli``; the last stdout line is one JSON object."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import torch
import typer

from ..api.generate import compile_steps
from ..config import KV_CACHES
from ..models.eagle3_format import load_head, random_head
from ..models.presets import DEFAULT_DRAFT, DEFAULT_TARGET
from .checks import check_output, parse_sizes, usage_errors
from .pair import QUANTIZATION_HELP
from .pair import load_pair as _load_pair


def profile(
    target: str = typer.Option(DEFAULT_TARGET, help="Target model: preset, .gguf path, directory or HF id."),
    draft: str = typer.Option(DEFAULT_DRAFT, help="Draft model, or 'none' (target only, for prompt lookup)."),
    quantization: str = typer.Option("auto", help=QUANTIZATION_HELP + " (--random-weights: give a format)."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 | float16 | float32."),
    quick: bool = typer.Option(False, help="Tiny grid for CI: n 1..4, batch 1..2, contexts 128 and 256, 1 repeat."),
    contexts: str = typer.Option("", help="Context lengths in tokens (default 128,512,1024,2048)."),
    batch_sizes: str = typer.Option("", help="Batch sizes (default 1,2,4,8,16)."),
    new_tokens: str = typer.Option("", help="New tokens per target forward (default 1..9,12,16,24,32)."),
    repeats: int | None = typer.Option(None, min=1, help="Timed rounds per cell, median kept (default 3; --quick 1)."),
    max_tokens_per_forward: int = typer.Option(64, min=1, help="Skip target cells with batch × new tokens above it."),
    output: Path | None = typer.Option(
        None,
        help="JSON out (default model_cards/<pair>/profile.json); "
        "cost_curves.png beside it; a copy goes to the cache for the engine.",
    ),
    device: str = typer.Option("cpu", help="cpu | cuda (timings synchronise the GPU; NF4 via bitsandbytes there)."),
    random_weights: bool = typer.Option(
        False,
        help="Build each model from its architecture (a preset's shipped "
        "config.json, or a folder's) with random weights: costs do not depend "
        "on the weights, so no model files are needed.",
    ),
    head: str = typer.Option(
        "",
        help="Profile an EAGLE-3 draft head as the drafter instead of --draft: a "
        "speculators folder, or random[:V[:I]] (the target's width, random weights, a draft "
        "vocabulary of V tokens, default 32000, and an MLP I wide, default the target's).",
    ),
    kv_cache: str = typer.Option(
        "auto",
        help="auto | dynamic | static: where the timed forwards keep their "
        "caches, as a request's would (auto: recorded CUDA graphs on a GPU).",
    ),
    compile_draft: bool = typer.Option(
        False,
        help="Record the draft's 1-token forward after torch.compile "
        "(hf_adaspec.compile_steps; GPU), as the engine will.",
    ),
) -> None:
    """Measure the pair's cost profile: target forwards vs new tokens × batch × context and draft forwards
    vs batch × context; table and fitted predictors scored per quantity on held-out cells. Last stdout line: JSON."""
    from ..costs import measure as profiling
    from ..costs.profile_files import default_profile_path, save_profile

    grid = profile_grid(quick, contexts, batch_sizes, new_tokens, repeats, max_tokens_per_forward)
    pair = profiling.pair_name(target, "head" if head else draft)
    output = output or Path("model_cards") / pair / "profile.json"
    check_output(output)
    with usage_errors(ValueError, hint="--head"):
        parse_random_head(head)  # a malformed random design fails before any model loads
    if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
        raise typer.BadParameter(f"{device!r}; use cpu, cuda or cuda:N", param_hint="--device")
    if kv_cache not in KV_CACHES:
        raise typer.BadParameter(f"{kv_cache!r}; use one of {', '.join(KV_CACHES)}", param_hint="--kv-cache")
    command = (
        f"hf-adaspec profile --target {target} --draft {draft} --quantization {quantization} --dtype {dtype} "
        f"--contexts {_csv(grid.contexts)} --batch-sizes {_csv(grid.batch_sizes)} --new-tokens "
        f"{_csv(grid.new_tokens)} --repeats {grid.repeats} "
        f"--max-tokens-per-forward {grid.max_tokens_per_forward} --device {device}"
        + (" --random-weights" if random_weights else "")
        + (f" --head {head}" if head else "")
        + (f" --kv-cache {kv_cache}" if kv_cache != "auto" else "")
        + (" --compile-draft" if compile_draft else "")
    )
    start = time.perf_counter()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter("--device cuda: torch sees no CUDA device (a CPU build of torch, or no GPU)")
    tgt, drf = _profiled_models(target, "none" if head else draft, quantization, dtype, device, random_weights)
    if head:
        with usage_errors(ValueError, FileNotFoundError, hint="--head"):
            drf = _head(head, tgt)
    if compile_draft and drf is not None:
        compile_steps(drf, (1,))
    result = profiling.measure_profile(tgt, drf, grid, pair, command, True, kv_cache)
    save_profile(result, output)
    cached = save_profile(result, default_profile_path(result.key))
    try:
        profiling.plot_profile(result, output.with_name("cost_curves.png"))
    except ImportError:
        typer.echo(
            "hf-adaspec: no PNG written; pip install matplotlib (or the [notebooks] extra) for the plot", err=True
        )
    held_out = len(result.held_out_target) + len(result.held_out_draft)
    cells = len(result.target_cells) + len(result.draft_cells) + held_out
    typer.echo(
        json.dumps(
            {
                "output": str(output),
                "cache_copy": str(cached),
                "cells_measured": cells,
                "held_out_cells": held_out,
                "held_out_mape_pct": {
                    q: {"table": _round(s.table_mape), "fit": _round(s.fit_mape)} for q, s in result.scores.items()
                },
                "predictors": {q: s.predictor for q, s in result.scores.items()},
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    )


def _profiled_models(target: str, draft: str, quantization: str, dtype: str, device: str, random_weights: bool):
    """(target, draft or None) models to profile: loaded, or built from their architectures."""
    if not random_weights:
        tgt, drf = _load_pair(target, draft, quantization, dtype, device)
        return tgt.model, drf.model if drf is not None else None
    from ..models.architecture import load_architecture

    try:
        return (
            load_architecture(target, quantization, dtype, device),
            load_architecture(draft, quantization, dtype, device, quantize_lm_head=True) if draft != "none" else None,
        )
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None


def _csv(values) -> str:
    return ",".join(str(v) for v in values)


def _round(value: float | None) -> float | None:
    return round(value, 2) if value is not None else None


HEAD_SPEC_HELP = (
    "random[:V[:I]] with V the draft vocabulary (tokens) and I the decoder layer's MLP "
    "intermediate size, positive integers, e.g. random:32000 or random:16000:2048"
)


def parse_random_head(spec: str) -> tuple[int, int | None] | None:
    """``--head``'s random design: ``random[:V[:I]]`` → (V, I), V default 32000, I None (the target's MLP
    width); None when ``spec`` names a folder. Raises ValueError naming the form for a malformed spec."""
    if spec != "random" and not spec.startswith("random:"):
        return None
    parts = spec.split(":")[1:]
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError(f"--head {spec!r}: use {HEAD_SPEC_HELP}")
    vocab = int(parts[0]) if parts else 32000
    return vocab, int(parts[1]) if len(parts) == 2 else None


def _head(spec: str, target):
    """The head ``--head`` names: ``random[:V[:I]]`` or a speculators folder (ValueError, FileNotFoundError)."""
    design = parse_random_head(spec)
    if design is not None:
        return random_head(target, design[0], intermediate_size=design[1])
    return load_head(Path(spec), target)


def profile_grid(
    quick: bool, contexts: str, batch_sizes: str, new_tokens: str, repeats: int | None, max_tokens_per_forward: int
):
    """The ``profile`` command's grid: the default (or ``--quick``) one with the given options replaced."""
    import dataclasses

    from ..costs.measure import QUICK_GRID, ProfileGrid

    lists = {"contexts": contexts, "batch_sizes": batch_sizes, "new_tokens": new_tokens}
    changes: dict = {
        name: tuple(parse_sizes(text, "--" + name.replace("_", "-"))) for name, text in lists.items() if text
    }
    if repeats is not None:
        changes["repeats"] = repeats
    base = QUICK_GRID if quick else ProfileGrid()
    try:
        return dataclasses.replace(base, max_tokens_per_forward=max_tokens_per_forward, **changes)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
