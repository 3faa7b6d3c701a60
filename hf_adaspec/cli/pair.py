"""Loading the (target, draft) pair the CLI commands run: quantized, enabled, kernels warmed up."""

from __future__ import annotations

import torch
import typer

from ..models.formats import choices_text

# the --quantization option's help, from the format registry
QUANTIZATION_HELP = (
    f"{choices_text()}. auto: the fastest format on this machine within the quality tolerance, "
    "measured at the first load."
)


def load_pair(target: str, draft: str, quantization: str, dtype: str, device: str = "cpu"):
    """(target, draft) ``LoadedModel``s on ``device`` (draft None for 'none'); the target's ``generate``
    takes ``speculation=``; one short generate each keeps first-call kernel set-up out of timed runs.
    Raises typer.BadParameter (the CLI prints it without a traceback) for a name load cannot resolve."""
    from .. import enable, load
    from ..models.assets import AssetError

    try:
        tgt = load(target, quantization=quantization, dtype=dtype, device=device)
        drf = (
            load(draft, quantization=quantization, dtype=dtype, quantize_lm_head=True, device=device)
            if draft != "none"
            else None
        )
    except (ValueError, FileNotFoundError, AssetError) as e:  # a wrong name or a missing part: say so, no traceback
        raise typer.BadParameter(str(e)) from None
    enable(tgt.model)
    for lm in (tgt, drf):
        if lm is not None:
            lm.model.generate(torch.tensor([[0, 1, 2, 3]], device=lm.model.device), max_new_tokens=2, do_sample=False)
    return tgt, drf
