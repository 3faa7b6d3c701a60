"""A draft model's output head over a frequency-ranked subset of its vocabulary (FR-Spec: Zhao et al. 2025, arXiv
2502.14856, section 3).

Design: the head's product covers the V' rows of the ranked ids instead of all V; the logits of every other id are
−inf, so the draft's distribution q lives on the subset and its argmax is the subset's. Lossless: the target
verifies over its full vocabulary, and speculative sampling needs only that each proposal was drawn from the q it
is judged by (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023): here q is 0 outside the subset, so a target
token there is reached by the residual norm(max(0, p − q)). Under greedy decoding only the acceptance changes: a
target token outside the subset is never proposed. The head keeps the logits' width (V), so nothing downstream
changes; only the draft's step gets cheaper (the head is a large share of a small draft's weights).
"""

from __future__ import annotations

import torch

from ..kernels.q4_layer import Q4Linear


class RankedHead(torch.nn.Module):
    """Logits over a ranked subset: x [..., H] → [..., V] float, −inf outside ``ids``.

    ``head``: the output head restricted to ``ids`` (``head_rows``), [..., H] → [..., V']; ``ids`` [V'] long, the
    vocabulary ids of its rows, unique and < ``vocab_size``. Raises ValueError otherwise."""

    def __init__(self, head: torch.nn.Module, ids: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() != 1 or ids.numel() != head.out_features:
            raise ValueError(f"ids must be [{head.out_features}] (one per row of the head), not {list(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size or ids.unique().numel() != ids.numel()):
            raise ValueError(f"ids must be unique vocabulary ids in [0, {vocab_size})")
        self.head, self.in_features, self.out_features = head, head.in_features, vocab_size
        self.register_buffer("ids", ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.head(x)  # [..., V']
        logits = y.new_full((*y.shape[:-1], self.out_features), float("-inf"))  # [..., V]
        return logits.index_copy_(-1, self.ids, y)


def head_rows(head: torch.nn.Module, ids: torch.Tensor) -> torch.nn.Module:
    """``head`` (an ``nn.Linear`` or a one-kind ``Q4Linear``) restricted to the rows ``ids`` [V'] long, in that
    order: a new layer of the same type sharing nothing with ``head``. Raises ValueError for another head type."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if isinstance(head, Q4Linear):
        return head.select_rows(ids)
    if type(head) is torch.nn.Linear:
        rows = torch.nn.Linear(head.in_features, ids.numel(), bias=head.bias is not None)
        rows = rows.to(device=head.weight.device, dtype=head.weight.dtype)
        with torch.no_grad():
            rows.weight.copy_(head.weight[ids.to(head.weight.device)])
            if head.bias is not None:
                rows.bias.copy_(head.bias[ids.to(head.bias.device)])
        return rows.requires_grad_(False)
    raise ValueError(f"a ranked head needs an nn.Linear or Q4Linear output head, not {type(head).__name__}")


def rank_output_head(model: torch.nn.Module, ids: torch.Tensor) -> torch.nn.Module:
    """Give ``model`` (a causal LM, in place) a ``RankedHead`` over ``ids`` [V'] (its rows of the current output
    head); returns ``model``. Its logits keep their width; its weights' identity changes, so its costs are measured
    again. Raises ValueError as ``RankedHead`` and ``head_rows``, and for a head already ranked."""
    head = model.get_output_embeddings()
    if isinstance(head, RankedHead):
        raise ValueError("the output head is already ranked: rank the original model")
    model.set_output_embeddings(RankedHead(head_rows(head, ids), ids, head.out_features))
    return model
