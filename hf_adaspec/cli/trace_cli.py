"""``hf-adaspec trace``: take greedy traces of a model pair over a prompts file, for ``replay`` to price.

Design: one trace file per prompt, written atomically, so a run is resumable: prompts already traced with the same
pair and length are reused (with ``--head`` they only gain the head's chains, no generation again) and what an
interrupted run left half-written is swept. Prompts are taken a category at a time so a partial run covers every
category. Registered on the CLI's app by ``cli``; the last stdout line is one JSON object. ``replay_cli`` reads
the traces.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer
from tqdm.auto import tqdm

from ..bench.prompts import PACKAGED_PER_CATEGORY, SPEC_BENCH, Prompt, load_prompts
from ..files import sweep
from ..models.presets import DEFAULT_DRAFT, DEFAULT_TARGET
from ..replay.trace import HEAD_DEPTH, load_trace, save_trace, take_trace, trace_path, with_head
from .checks import check_output, check_prompts_file, usage_errors
from .pair import QUANTIZATION_HELP, load_pair

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


def _existing(directory: Path, prompt: Prompt, max_new_tokens: int, names: tuple[str, str]):
    """The finished trace of this prompt, length and pair already there (a resumed run reuses it), or None."""
    path = trace_path(directory, prompt.question_id)
    if not path.is_file():
        return None
    try:
        t = load_trace(path)
    except ValueError:
        return None
    return t if (t.max_new_tokens, t.target, t.draft) == (max_new_tokens, *names) else None


def trace(
    prompts: Path = typer.Option(
        SPEC_BENCH, help="Spec-Bench style JSONL (question_id, category, turns).", show_default=SPEC_BENCH_SHOWN
    ),
    per_category: int = typer.Option(8, min=1, help="Prompts per category (the first ones of each)."),
    max_new_tokens: int = typer.Option(256, min=1),
    output: Path = typer.Option(Path("benchmarks/traces"), help="Directory: one <question_id>.json per prompt."),
    target: str = typer.Option(DEFAULT_TARGET),
    draft: str = typer.Option(DEFAULT_DRAFT, help="Draft model, or 'none' (traces for prompt lookup only)."),
    quantization: str = typer.Option("auto", help=QUANTIZATION_HELP),
    dtype: str = typer.Option("bfloat16"),
    workload: str = typer.Option("", help="Workload name stored in each trace (default: the prompts file's stem)."),
    head: str = typer.Option(
        "",
        help="Also record an EAGLE-3 head's chains (a speculators folder) along each "
        "output, for replay's head methods; traces of the pair already there gain them "
        "without generating again.",
    ),
    head_depth: int = typer.Option(HEAD_DEPTH, min=1, help="Tokens of the head's chain recorded per position."),
) -> None:
    """Per prompt: the target's plain greedy output and the draft's argmax and q(x) along it (one teacher-forced
    pass), and with --head the head's chains, for ``replay``. Resumable: prompts already traced with the same
    pair, length and head are skipped, and what an interrupted run left half-written is removed."""
    check_output(output, folder=True)
    check_prompts_file(prompts)
    if head and not Path(head).is_dir():
        raise typer.BadParameter(
            f"no folder at {head}; give a speculators-format head folder (config.json + model.safetensors)",
            param_hint="--head",
        )
    with usage_errors(FileNotFoundError, hint="--prompts"):
        selected = interleave_categories(load_prompts(prompts, per_category))
    sweep(output)
    names = (target, "" if draft == "none" else draft)
    found = {p.question_id: _existing(output, p, max_new_tokens, names) for p in selected}
    todo = [
        p
        for p in selected
        if found[p.question_id] is None
        or (head and (found[p.question_id].head, found[p.question_id].head_depth) != (head, head_depth))
    ]
    start = time.perf_counter()
    if todo:
        generate = any(found[p.question_id] is None for p in todo)
        tgt, drf = load_pair(target, draft if generate else "none", quantization, dtype)
        chains = _load_head(head, tgt.model) if head else None
        for p in tqdm(todo, desc="trace prompts"):
            t = found[p.question_id] or take_trace(
                tgt.model,
                tgt.tokenizer,
                drf.model if drf is not None else None,
                p,
                max_new_tokens,
                names,
                source=workload or prompts.stem,
            )
            save_trace(with_head(t, tgt.model, chains, head, head_depth) if chains is not None else t, output)
    typer.echo(
        json.dumps(
            {
                "output": str(output),
                "prompts": len(selected),
                "traced_now": len(todo),
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    )


def _load_head(folder: str, target):
    """The head at ``folder`` for ``target``; a usage error of ``--head`` naming the fix otherwise."""
    from ..models.eagle3_format import load_head

    with usage_errors(ValueError, FileNotFoundError, hint="--head"):
        return load_head(Path(folder), target)
