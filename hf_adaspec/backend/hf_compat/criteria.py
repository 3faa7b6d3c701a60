"""What the engine reads from ``generate``'s prepared stopping criteria and logits processors, so that a step
checks and processes its whole accepted span at once where that gives the same answer as token by token.

- ``split_stopping``: transformers' ``MaxLengthCriteria`` and ``EosTokenCriteria`` read only the sequence's
  length and its last token, so the engine checks them over a span in Python (no tensor op, no host read);
  every other criterion (stop strings, a caller's own, ``MaxTimeCriteria``) is kept, to be asked per prefix.
- ``position_free``: a processor list whose every processor reads only the scores, never the ids before them
  (temperature, top-k, top-p, min-p, typical, ε/η sampling, suppressed tokens, NaN removal, normalization), can
  run once over all positions of all rows, ``[Σ(k_i + 1), V]``; any other (repetition penalty, n-gram bans,
  minimum lengths, forced tokens, a caller's own) needs each position's own prefix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import (
    EosTokenCriteria,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    MaxLengthCriteria,
    MinPLogitsWarper,
    StoppingCriteriaList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)
from transformers.generation.logits_process import LogitNormalization

_POSITION_FREE = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    SuppressTokensLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
)


@dataclass(frozen=True)
class StopSplit:
    """``eos``: token ids a row stops after; ``max_length``: the padded row length it stops at (None: no cap);
    ``others``: the remaining criteria, asked as ``others(ids [1, T], None)`` → [1] bool (None: none)."""

    eos: frozenset[int]
    max_length: int | None
    others: Callable[[torch.Tensor, None], torch.Tensor] | None


def split_stopping(criteria: object) -> StopSplit:
    """``criteria``: a ``StoppingCriteriaList`` (or None/empty) → its EOS ids, its smallest max length and the
    criteria left (exactly transformers' classes are read; a subclass is kept among the others); any other
    callable ``(ids, scores) → [B] bool`` is kept whole among the others."""
    if criteria is not None and not isinstance(criteria, StoppingCriteriaList):
        return StopSplit(frozenset(), None, criteria)
    eos: set[int] = set()
    max_length, others = None, []
    for criterion in criteria or ():
        if type(criterion) is EosTokenCriteria:
            eos.update(int(t) for t in criterion.eos_token_id.flatten().tolist())
        elif type(criterion) is MaxLengthCriteria:
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        else:
            others.append(criterion)
    return StopSplit(frozenset(eos), max_length, StoppingCriteriaList(others) if others else None)


def position_free(processor: object) -> bool:
    """Whether every processor of ``processor`` (a ``LogitsProcessorList``, or None/empty: True) reads only the
    scores, so it may run over many positions at once with ids it ignores."""
    return all(type(p) in _POSITION_FREE for p in processor or ())
