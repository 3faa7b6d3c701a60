"""The last-dim argmax of scores on a CPU by numpy's vectorised loop: torch's CPU argmax walks the vocabulary one
element at a time, a cost every greedy step pays once per verified position and once per drafted token.

The same answer as ``torch.argmax(scores, dim=-1)``: the first maximal index (ties), the first NaN where there is
one. Other devices and dtypes numpy lacks (bfloat16) go to torch.
"""

from __future__ import annotations

import numpy as np
import torch

_NUMPY_DTYPES = (torch.float32, torch.float64)


def argmax(scores: torch.Tensor) -> torch.Tensor:
    """scores [..., V] → [...] long (on the scores' device): the index of each row's maximum."""
    if scores.device.type != "cpu" or scores.dtype not in _NUMPY_DTYPES or scores.requires_grad:
        return scores.argmax(dim=-1)
    return torch.from_numpy(np.argmax(scores.numpy(), axis=-1))
