"""The ``train-head`` command: record what is missing (``head_data``), then train or resume (``train_head``).

Registered on the CLI's app by ``cli``; the last stdout line is one JSON object (the head's folder, the
curve's file and its last point).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..costs.profile_files import load_profile
from ..files import atomic_write
from ..models.eagle3_format import load_head
from ..models.presets import DEFAULT_TARGET
from ..replay.trace import load_traces
from .pair import QUANTIZATION_HELP


def default_sources() -> list[Path]:
    """The installed transformers and torch packages' own Python source (Apache-2.0 and BSD-3-Clause)."""
    import torch
    import transformers

    return [Path(transformers.__file__).parent, Path(torch.__file__).parent]


def train_head(
    target: str = typer.Option(DEFAULT_TARGET, help="Target model (preset name or path)."),
    tokens: int = typer.Option(200_000, help="Training tokens: the first this many of the recorded stream."),
    data: Path = typer.Option(Path("runs/head-data"), help="Folder of recorded shards (shared by runs)."),
    out: Path = typer.Option(None, help="Run folder (checkpoint, curve, head/); default runs/head-<tokens>."),
    source: list[Path] = typer.Option(
        None,
        help="Folders of Python source to train on (repeatable); "
        "default: the installed transformers and torch packages.",
    ),
    traces: Path = typer.Option(Path("benchmarks/traces"), help="Greedy traces: held-out ones validate."),
    epochs: float = typer.Option(2.0, help="Passes over the data."),
    train_steps: int = typer.Option(0, help="Optimizer steps (0: epochs decide); equal steps compare data sizes."),
    validation_sequences: int = typer.Option(0, help="Validate on this many evenly spaced traces per set (0: all)."),
    steps: int = typer.Option(3, help="Training-time-test steps (draft depth trained)."),
    lr: float = typer.Option(5e-4, help="Peak AdamW learning rate."),
    batch: int = typer.Option(4, help="Sequences per optimizer step."),
    draft_vocab: int = typer.Option(16000, help="Draft vocabulary size."),
    intermediate: int = typer.Option(2048, help="The head's MLP width."),
    eval_every: int = typer.Option(50, help="Optimizer steps between validation points."),
    seq_len: int = typer.Option(512, help="Tokens per training sequence."),
    quantization: str = typer.Option("auto", help="The target's weight format (as served): " + QUANTIZATION_HELP),
    dtype: str = typer.Option("bfloat16", help="The target's dtype."),
    profile: Path = typer.Option(
        Path("model_cards/qwen2.5-coder-1.5b_0.5b/profile.json"),
        help="The pair's cost profile: the draft model's goodput the head must beat.",
    ),
):
    """Train an EAGLE-3 draft head for TARGET by self-distillation; resumable, curve in curve.jsonl."""
    from .. import load
    from ..training.head_data import held_out, read_shards, record, record_traces
    from ..training.train_head import TrainConfig, train

    config = TrainConfig(
        tokens,
        epochs,
        steps,
        lr,
        batch=batch,
        draft_vocab=draft_vocab,
        intermediate=intermediate,
        eval_every=eval_every,
        train_steps=train_steps,
    )
    out = out or Path(f"runs/head-{tokens}")
    loaded = load(target, quantization=quantization, dtype=dtype)
    aux = _aux_layers(loaded.model)
    shards = record(
        loaded.model, loaded.tokenizer, source or default_sources(), data / f"seq{seq_len}", tokens, aux, seq_len
    )
    all_traces = load_traces(traces)
    validation = {
        name: _spaced(
            record_traces(loaded.model, held_out(all_traces, name), data / f"val-{name}.safetensors", aux),
            validation_sequences,
        )
        for name in ("spec_bench", "code")
    }
    head = train(loaded.model, read_shards(shards), validation, config, out)
    last = [json.loads(line) for line in (out / "curve.jsonl").read_text().splitlines()][-1]
    costs = break_even(load_profile(profile), load_head(head, loaded.model), held_out(all_traces, "spec_bench"))
    costs["predicted_speedup"] = {
        name: predicted_speedup(alpha, costs["head_ms"], load_profile(profile)) for name, alpha in last["alpha"].items()
    }
    atomic_write(out / "break_even.json", lambda f: f.write(json.dumps(costs, indent=2).encode()))
    typer.echo(json.dumps({"head": str(head), "curve": str(out / "curve.jsonl"), "last": last, "break_even": costs}))


def break_even(profile, head, traces, context: int = 512, repeats: int = 15) -> dict:
    """The agreement a head needs: its cost per drafted token measured here (``HeadProbe``, median of
    ``repeats``), the draft model's acceptance α on ``traces`` (its argmax is the target's token) and the
    profile's costs at ``context`` (its fitted lines: a table cell carries its own noise) → the i.i.d. α at
    which the head's best goodput equals the draft model's, and at which it reaches 1.5x plain
    (``policy.goodput.break_even_alpha``); times in ms."""
    import statistics

    from ..costs.table import HeadProbe
    from ..policy.goodput import best_goodput, break_even_alpha

    probe = HeadProbe(head, context)
    head_ms = statistics.median(probe.time_ms(1) for _ in range(repeats))
    hits = [
        int(t.draft_next[j] == t.tokens[t.prompt_len + j]) for t in traces for j in range(len(t.tokens) - t.prompt_len)
    ]
    alpha = sum(hits) / len(hits)

    def verify(n: int) -> float:
        return profile.verify_ms(1, context, n, forced="fit")

    rival = best_goodput(alpha, profile.draft_ms(1, context, forced="fit"), verify)
    return {
        "context": context,
        "head_ms": round(head_ms, 2),
        "target_step_ms": round(verify(1), 2),
        "draft_ms": round(profile.draft_ms(1, context, forced="fit"), 2),
        "draft_alpha": round(alpha, 4),
        "draft_speedup": round(rival * verify(1) / 1000, 3),
        "break_even_alpha": round(break_even_alpha(head_ms, verify, rival), 4),
        "alpha_for_1_5x": round(break_even_alpha(head_ms, verify, 1.5 * 1000 / verify(1)), 4),
    }


def predicted_speedup(alphas: list[float], head_ms: float, profile, context: int = 512) -> float:
    """A prediction, not a measurement: the head's best goodput over k = 0..len(alphas) against plain decoding,
    with step-s acceptance ``alphas[s-1]`` conditional on the earlier tokens (P_k = α_1···α_k, Leviathan et
    al. 2023, Eq. 1 without i.i.d.), the head's ``head_ms`` a token and the profile's fitted verification at
    ``context``."""
    from ..policy.goodput import expected_tokens_prefix, step_time_ms

    def verify(n: int) -> float:
        return profile.verify_ms(1, context, n, forced="fit")

    prefix, best = [], 1000.0 / verify(1)
    for alpha in alphas:
        prefix.append((prefix[-1] if prefix else 1.0) * alpha)
        best = max(best, 1000.0 * expected_tokens_prefix(prefix) / step_time_ms(len(prefix), head_ms, verify))
    return round(best * verify(1) / 1000.0, 3)


def _spaced(data, count: int):
    """``count`` evenly spaced sequences of ``data`` (all when count is 0 or at least their number)."""
    import torch

    if not 0 < count < len(data):
        return data
    return data.rows(torch.linspace(0, len(data) - 1, count).round().long())


def _aux_layers(model) -> tuple[int, int, int]:
    from ..models.eagle3_format import default_aux_layers

    return default_aux_layers(model.config.get_text_config().num_hidden_layers)
