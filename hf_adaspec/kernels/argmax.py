"""The argmax over a vocabulary, a greedy step's reduction: numpy's vectorized argmax for float32 host tensors
(torch's CPU argmax reduces without SIMD, many times slower over a large vocabulary), torch's everywhere else.

Both follow one rule: the first index of the largest value, NaN counted as the largest (``torch.argmax`` and
``numpy.argmax`` alike), so a greedy token does not depend on which of the two chose it.
"""

from __future__ import annotations

import numpy as np
import torch


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """The index of the largest value over the last dimension: scores [..., V] → [...] long on scores' device
    (the first of equal maxima; NaN counts as the largest)."""
    if scores.is_cpu and scores.dtype == torch.float32 and not scores.requires_grad:
        return torch.from_numpy(scores.numpy().argmax(axis=-1).astype(np.int64, copy=False))
    return scores.argmax(dim=-1)
