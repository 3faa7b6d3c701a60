"""``hf-adaspec`` command line: ``generate`` (stream text, then one stats line), ``bench``, ``profile`` (cost
profile of a model pair) and ``playground``; ``trace``, ``replay``, ``export-vllm`` and ``check-files`` live in
modules of their own. Bad input is a usage error: one ``Error:`` line naming the fix, exit code 2, no traceback."""

from __future__ import annotations

import importlib.util
import json
import platform
import time
from pathlib import Path

import typer
from tqdm.auto import tqdm

from ..bench.bench import METHODS
from ..bench.prompts import SPLITS, Prompt, load_prompts
from ..config import SPECULATION_MODES
from ..models.eagle3_format import load_head
from ..models.presets import DEFAULT_DRAFT, DEFAULT_TARGET
from . import check_files_cli, export_cli, profile_cli, replay_cli, trace_cli, train_head_cli
from .checks import check_output, check_prompts_file, parse_methods, parse_sizes, usage_errors
from .pair import QUANTIZATION_HELP
from .pair import load_pair as _load_pair

# rich_markup_mode=None: an error is printed as one plain ``Error: ...`` line, not wrapped in a panel
app = typer.Typer(
    help="Adaptive speculative decoding for Hugging Face transformers.", no_args_is_help=True, rich_markup_mode=None
)

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome, with a docstring and tests."
SPEC_BENCH = trace_cli.SPEC_BENCH  # the packaged Spec-Bench subset (hf_adaspec/data/spec_bench.jsonl)
app.command()(trace_cli.trace)
app.command()(replay_cli.replay)
app.command("export-vllm")(export_cli.export_vllm)
app.command("check-files")(check_files_cli.check_files)
app.command(hidden=True)(check_files_cli.verify)  # the old name, for one release (check_files_cli.RENAMED)
app.command()(profile_cli.profile)
app.command("train-head")(train_head_cli.train_head)


@app.command()
def generate(
    prompt: str = typer.Argument(DEFAULT_PROMPT, help="User message; the chat template is applied."),
    target: str = typer.Option(DEFAULT_TARGET, help="Target model: preset, .gguf path, directory or HF id."),
    draft: str = typer.Option(DEFAULT_DRAFT, help="Draft model, or 'none' for prompt lookup."),
    head: Path | None = typer.Option(None, help="An EAGLE-3 draft head (speculators folder) instead of --draft."),
    speculation: str = typer.Option("adaptive", help=" | ".join(SPECULATION_MODES) + " | off (plain decoding)."),
    k: int = typer.Option(5, min=0, max=64, help="Proposal length for --speculation fixed (0..64)."),
    max_new_tokens: int = typer.Option(256, min=1),
    quantization: str = typer.Option("auto", help=QUANTIZATION_HELP),
    dtype: str = typer.Option("bfloat16", help="bfloat16 | float16 | float32."),
    do_sample: bool = typer.Option(False, help="Sample (lossless speculative sampling) instead of greedy."),
    temperature: float = typer.Option(0.7),
    top_p: float = typer.Option(0.9),
) -> None:
    """Generate for one prompt, streaming the text; then print one stats line."""
    from transformers import TextStreamer

    if speculation not in (*SPECULATION_MODES, "off"):
        raise typer.BadParameter(f"--speculation {speculation!r}: use one of {', '.join(SPECULATION_MODES)} or off")
    if do_sample and not (temperature > 0 and 0 < top_p <= 1):
        raise typer.BadParameter(
            f"--temperature {temperature} --top-p {top_p}: sampling needs a temperature > 0 "
            "and 0 < top-p <= 1 (or leave --do-sample out for greedy)"
        )

    tgt, drf = _load_pair(target, "none" if head else draft, quantization, dtype)
    inputs = tgt.tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    kwargs: dict = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "return_dict_in_generate": True}
    if do_sample:
        kwargs.update(temperature=temperature, top_p=top_p)
    if speculation != "off":
        kwargs.update(speculation=speculation, num_speculative_tokens=k if speculation == "fixed" else None)
        if drf is not None or head:
            with usage_errors(ValueError, FileNotFoundError, hint="--head"):
                kwargs["assistant_model"] = load_head(head, tgt.model) if head else drf.model
    streamer = TextStreamer(tgt.tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    with usage_errors(ValueError):  # settings generate refuses, e.g. a draft with another vocabulary
        out = tgt.model.generate(**inputs, streamer=streamer, **kwargs)
    seconds = time.perf_counter() - start
    stats = getattr(out, "speculation", None)
    if stats is not None:
        typer.echo(f"[hf-adaspec] {speculation}: {stats.summary()}")
    else:
        new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
        typer.echo(f"[hf-adaspec] plain: {new} tokens in {seconds:.2f} s = {new / seconds:.2f} tokens/s")


@app.command()
def bench(
    prompts: Path = typer.Option(
        SPEC_BENCH,
        help="Spec-Bench style JSONL (fields question_id, category, turns).",
        show_default=trace_cli.SPEC_BENCH_SHOWN,
    ),
    per_category: int = typer.Option(1, min=1, help="Prompts per category (the packaged default file has 8)."),
    categories: str = typer.Option("", help="Comma-separated categories (default: all)."),
    split: str = typer.Option("all", help="all | tune (even question ids) | held-out (odd)."),
    methods: str = typer.Option(",".join(METHODS), help="Comma-separated subset of the methods."),
    max_new_tokens: int = typer.Option(256, min=1),
    fixed_k: int = typer.Option(5, min=1, max=64, help="k for the fixed-k method (1..64)."),
    repeats: int = typer.Option(1, min=1, help="Timed runs per method and prompt (median)."),
    target: str = typer.Option(DEFAULT_TARGET),
    draft: str = typer.Option(DEFAULT_DRAFT),
    quantization: str = typer.Option("auto", help=QUANTIZATION_HELP),
    dtype: str = typer.Option("bfloat16"),
    output: Path = typer.Option(Path("benchmarks/results/bench.json"), help="JSON out; a .md table beside it."),
    batch_size: str = typer.Option(
        "",
        help="e.g. 1,2,4,8,16: the batch benchmark (plain batched generate, "
        "hf-assisted, fixed-k, adaptive) at these batch sizes instead.",
    ),
    batch_prompts: int = typer.Option(16, min=1, help="Prompts for the batch benchmark (round-robin over categories)."),
    batch_methods: str = typer.Option(
        "",
        help="Comma-separated subset of the batch methods (default: all of "
        "plain, plain-again (A/A), hf-assisted, fixed-k, adaptive).",
    ),
) -> None:
    """Interleaved benchmark per prompt; writes JSON + markdown; last stdout line is one JSON object."""
    from ..bench import bench as bm
    from ..bench.summary import markdown, summarize, write_results

    check_output(output)
    check_prompts_file(prompts)
    if batch_size:
        sizes = parse_sizes(batch_size)
        _batch_bench(
            prompts,
            sizes,
            batch_prompts,
            max_new_tokens,
            fixed_k,
            target,
            draft,
            quantization,
            dtype,
            output,
            batch_methods,
        )
        return
    method_list = parse_methods(methods, METHODS, "--methods", draft, bm.NEEDS_DRAFT)
    selected = _bench_prompts(prompts, per_category, categories, split)
    tgt, drf = _load_pair(target, draft, quantization, dtype)
    draft_model = drf.model if drf is not None else None
    warm = Prompt(-1, "warm-up", "Say hello.")
    bm.run_prompt(
        tgt.model, tgt.tokenizer, draft_model, warm, method_list, 0, {"fixed_k": fixed_k, "max_new_tokens": 8}
    )
    runs, oracles = [], []
    cfg = {
        "fixed_k": fixed_k,
        "max_new_tokens": max_new_tokens,
        "repeats": repeats,
        "k_max": 8,
        "costs": _controller_costs(tgt.model, draft_model, 8),
        "states": {},
    }
    for i, prompt in enumerate(tqdm(selected, desc="bench prompts")):
        result = bm.run_prompt(tgt.model, tgt.tokenizer, draft_model, prompt, method_list, i, cfg)
        runs += result.runs
        oracles += [result.oracle] if result.oracle is not None else []
    summary = summarize(runs, method_list, oracles)
    meta = {
        "target": target,
        "draft": draft,
        "quantization": tgt.format_label,
        "dtype": dtype,
        "methods": method_list,
        "max_new_tokens": max_new_tokens,
        "per_category": per_category,
        "split": split,
        "fixed_k": fixed_k,
        "repeats": repeats,
        "learned_state": "per method",
        "machine": platform.machine(),
        "prompts_file": str(prompts),
        "oracle_k_max": 8,
    }
    write_results(output, runs, summary, meta, oracles)
    typer.echo(markdown(summary, method_list))
    _echo_overall(summary, method_list, output)


def _echo_overall(summary: dict, method_list: list[str], output: Path) -> None:
    """The bench's last stdout line: one JSON object of overall speedups, % of oracle and greedy checks."""
    overall = summary["table"]["overall"]
    typer.echo(
        json.dumps(
            {
                "output": str(output),
                "prompts": summary["prompts"],
                "overall_speedup": {m: round(overall[m]["speedup"], 3) for m in method_list},
                "pct_oracle": {
                    m: round(overall[m]["pct_oracle"], 1) for m in method_list if overall[m]["pct_oracle"] is not None
                },
                "greedy_mismatches": summary["greedy_mismatches"],
                "max_divergence_gap": summary["max_divergence_gap"],
            }
        )
    )


def _controller_costs(model, draft_model, k_max: int):
    """costs(context) → the CostTable the adaptive controller uses for this pair at a prompt of
    ``context`` tokens (a matching profile, else the cached calibration), for the oracle."""
    import functools
    import sys

    from ..costs.cache import CostCache

    log = functools.partial(print, file=sys.stderr)
    return lambda context: CostCache().load_or_measure(model, draft_model, k_max + 1, log, context=context)


def _bench_prompts(path: Path, per_category: int, categories: str, split: str) -> list[Prompt]:
    """The bench's prompts (``load_prompts``); a usage error for a missing file, an unknown split, or a
    selection that holds no prompt."""
    if split not in SPLITS:
        raise typer.BadParameter(f"{split!r}; choose one of {', '.join(SPLITS)}", param_hint="--split")
    wanted = [c for c in categories.split(",") if c] or None
    with usage_errors(FileNotFoundError, hint="--prompts"):
        selected = load_prompts(path, per_category, wanted, split)
    if not selected:
        there = sorted({p.category for p in load_prompts(path, 1)})
        raise typer.BadParameter(
            f"no prompts of {path} match --categories {categories!r} with --split {split}; "
            f"its categories: {', '.join(there)}",
            param_hint="--categories",
        )
    return selected


def _batch_bench(
    prompts, sizes, count, max_new_tokens, fixed_k, target, draft, quantization, dtype, output, batch_methods: str = ""
) -> None:
    """``bench --batch-size``: every size on the same prompts; JSON + markdown + PNG; last line JSON."""
    from ..bench import batch as bb

    methods = parse_methods(
        batch_methods or ",".join(bb.BATCH_METHODS), bb.BATCH_METHODS, "--batch-methods", draft, bb.NEEDS_DRAFT
    )
    with usage_errors(FileNotFoundError, ValueError, hint="--prompts"):
        selected = bb.pick_prompts(prompts, max(count, max(sizes)))
    tgt, drf = _load_pair(target, draft, quantization, dtype)
    cfg = {"fixed_k": fixed_k, "max_new_tokens": max_new_tokens}
    runs = bb.run_sizes(tgt.model, tgt.tokenizer, drf.model if drf is not None else None, selected, sizes, methods, cfg)
    summary = bb.summarize(runs, methods)
    meta = {
        "target": target,
        "draft": draft,
        "quantization": tgt.format_label,
        "dtype": dtype,
        "methods": methods,
        "batch_sizes": sizes,
        "prompts": len(selected),
        "max_new_tokens": max_new_tokens,
        "fixed_k": fixed_k,
        "machine": platform.machine(),
        "prompts_file": str(prompts),
    }
    bb.write_results(output, runs, summary, meta)
    typer.echo(bb.markdown(summary, methods))
    typer.echo(json.dumps(bb.overall_line(summary, output, len(selected), methods)))


@app.command()
def playground(
    pair: str = typer.Option("qwen", help="Model pair loaded at start: qwen (default) or smollm2 (small)."),
    host: str = typer.Option("127.0.0.1", help="Interface to serve on (localhost by default)."),
    port: int = typer.Option(7860, min=1, max=65535),
    max_prompt_tokens: int = typer.Option(2048, min=1, help="Longer prompts are refused with a message."),
    concurrency: int = typer.Option(1, min=1, help="Generations running at once (the queue holds the rest)."),
) -> None:
    """Serve the Gradio playground: live speculation decisions, coloured tokens, k and step-time charts, the
    speedup over plain. Exits 1 (before loading a model) where Gradio is not installed (``make demo`` leaves it
    out), naming the install."""
    if importlib.util.find_spec("gradio") is None:
        typer.echo(
            "hf-adaspec: the playground needs Gradio, which `make demo` does not install: run `make playground`, "
            "or pip install -e '.[playground]'",
            err=True,
        )
        raise typer.Exit(1)
    from ..playground.playground import PAIRS, launch

    if pair not in PAIRS:
        raise typer.BadParameter(f"--pair {pair!r}: use one of {', '.join(PAIRS)}")
    launch(pair=pair, host=host, port=port, max_prompt_tokens=max_prompt_tokens, concurrency=concurrency)
