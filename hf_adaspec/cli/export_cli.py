"""``hf-adaspec export-vllm``: what a cost profile and traced acceptance imply for vLLM's speculative decoding.

Registered on the CLI's app by ``cli`` (``app.command("export-vllm")(export_cli.export_vllm)``); the last
stdout line is one JSON object. The computation is ``export_vllm`` (pure functions, sources there).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..files import atomic_write


def export_vllm(
    traces: Annotated[Path, typer.Argument(help="Directory of `hf-adaspec trace` files (acceptance α).")],
    profile: Annotated[Path, typer.Argument(help="Cost profile JSON (`hf-adaspec profile`).")],
    method: Annotated[str, typer.Option(help="draft_model | ngram | eagle3 (vLLM's method).")] = "draft_model",
    draft_model: Annotated[
        str, typer.Option(help="vLLM's 'model' key for draft_model.")
    ] = "Qwen/Qwen2.5-Coder-0.5B-Instruct",
    head_model: Annotated[
        str,
        typer.Option(
            help="vLLM's 'model' key for eagle3: the head's folder or HF id "
            "(its chains in the traces: `hf-adaspec trace --head`; the "
            "profile measured with it: `hf-adaspec profile --head`)."
        ),
    ] = "",
    context: Annotated[int, typer.Option(min=1, help="Context length (tokens) the costs are read at.")] = 512,
    k_max: Annotated[int, typer.Option(min=0, help="Largest proposal length considered.")] = 8,
    output: Annotated[Path, typer.Option(help="JSON out: speculative_config + hf_adaspec provenance.")] = Path(
        "vllm_speculative_config.json"
    ),
) -> None:
    """Choose, per measured batch size, the proposal length of highest predicted goodput and write it as
    vLLM's speculative_config (num_speculative_tokens_per_batch_size when it varies); with --method eagle3
    the head named by --head-model, priced by its traced chains and the head's profile. Last stdout line:
    one JSON object {"output", "speculative_config"}."""
    from ..costs.profile_files import load_profile
    from ..replay.export_vllm import acceptance_from_traces, head_prefix_acceptance, speculative_config
    from ..replay.trace import load_traces
    from .trace_cli import check_output

    check_output(output)
    if method == "eagle3" and not head_model:
        raise typer.BadParameter("--method eagle3 needs --head-model, the head's folder or HF id (vLLM's 'model')")
    try:
        loaded = load_traces(traces)
        document = speculative_config(
            load_profile(profile),
            acceptance_from_traces(loaded),
            method,
            head_model if method == "eagle3" else draft_model,
            context,
            k_max,
            head_prefix_acceptance(loaded),
        )
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(" ".join(str(e).split())) from None
    document["hf_adaspec"].update(traces=str(traces), prompts=len(loaded), profile_path=str(profile))
    atomic_write(output, lambda f: f.write((json.dumps(document, indent=2) + "\n").encode()))
    typer.echo(json.dumps({"output": str(output), "speculative_config": document["speculative_config"]}))
