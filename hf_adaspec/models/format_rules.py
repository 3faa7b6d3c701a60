"""Which weight format ``quantization="auto"`` (``format_choice``) loads, given every format's measure.

Design: pure functions of the measures (``format_probe.FormatMeasure``), so the rules are tested without loading
a model and the GPU check applies them to its own measures. Quality first: a format is eligible when its top-1
agreement with the dense model is at most ``QUALITY_TOLERANCE`` below NF4's (or the best quantized format's where
NF4 did not load); dense weights, and a format that ran a GGUF file's own blocks unscored, always are. Then speed:
the eligible format with the least ``format_probe.score`` wins, but NF4 (the default before ``auto``) stays unless
another's score is ``SWITCH_MARGIN`` below its own, so a near-tie within the probe's run-to-run spread does not flip
the choice. A quantized output head is a variant of the chosen format, held to the same bar and margin
(``keep_head``).
"""

from __future__ import annotations

from .format_probe import FormatMeasure, score

QUALITY_TOLERANCE = 0.02  # eligible: top-1 agreement ≥ NF4's − this
SWITCH_MARGIN = 0.05  # another format replaces an eligible NF4 only when its score is this share below NF4's


def eligible(measures: tuple[FormatMeasure, ...]) -> list[FormatMeasure]:
    """Loaded formats whose top-1 agreement is within ``QUALITY_TOLERANCE`` of NF4's (where NF4 did not load,
    of the best quantized format's; dense weights, and a format that ran the GGUF file's own blocks unscored
    (``exact``), are always within). The bar comes from the formats with a dense output head; a quantized-head
    variant (``head``) is held to it too."""
    loaded = [m for m in measures if m.error is None and (m.top1 is not None or m.format == "none" or m.exact)]
    nf4 = [m.top1 for m in loaded if m.format == "nf4" and not m.head]
    quantized = [m.top1 for m in loaded if m.format != "none" and not m.head and m.top1 is not None]
    bar = (nf4 or [max(quantized, default=1.0)])[0] - QUALITY_TOLERANCE
    return [m for m in loaded if (m.format == "none" and not m.head) or m.exact or m.top1 >= bar]


def pick(measures: tuple[FormatMeasure, ...]) -> str:
    """The eligible format with the least ``score``; NF4 (the default before ``auto``) where it is eligible and no
    format's score is ``SWITCH_MARGIN`` below its own (a near-tie is within the probe's run-to-run spread).
    Quantized-head variants are not candidates here (``keep_head``). Raises ValueError when no format loaded (the
    message lists each one's error)."""
    ok = [m for m in eligible(measures) if not m.head]
    if not ok:
        raise ValueError("no weight format loaded: " + "; ".join(f"{m.format}: {m.error}" for m in measures))
    best = min(ok, key=lambda m: score(m.ms_1, m.ms_k))
    nf4 = next((m for m in ok if m.format == "nf4"), None)
    if nf4 is not None and score(best.ms_1, best.ms_k) > (1 - SWITCH_MARGIN) * score(nf4.ms_1, nf4.ms_k):
        return "nf4"
    return best.format


def keep_head(measures: tuple[FormatMeasure, ...], chosen: str) -> bool:
    """Whether ``chosen`` (``pick``'s format) is loaded with its output head quantized too: its ``head`` variant was
    measured, is eligible (``eligible``: the same quality bar) and its score is ``SWITCH_MARGIN`` below the
    dense head's."""
    body = next(m for m in measures if m.format == chosen and not m.head)
    variant = next((m for m in eligible(measures) if m.format == chosen and m.head), None)
    if variant is None:
        return False
    return score(variant.ms_1, variant.ms_k) <= (1 - SWITCH_MARGIN) * score(body.ms_1, body.ms_k)
