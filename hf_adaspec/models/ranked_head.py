"""A draft's output head over a frequency-ranked subset S of the vocabulary (FR-Spec, Zhao et al., arXiv 2502.14856).

Design: a small draft's head over the whole vocabulary (V × H) is a large share of its weights, so of the memory one
draft token reads. ``RankedHead`` multiplies only the rows of S (the most frequent tokens of a ranking,
``vocab_rank``) and returns logits over the full vocabulary, [..., V], with −inf outside S: the drafter interface is
unchanged, greedy drafting never proposes a token outside S, and under sampling the draft's q (softmax of the
processed logits) is a distribution on S, which lossless speculative sampling allows (the target verifies over its
full vocabulary; a token outside S is reached by the resampled correction). The rows of S are copied from the head it
replaces: a ``kernels.q4.Q4Linear``'s blocks (the same blocks, so logits inside S equal the full head's exactly) or
an ``nn.Linear``'s weight. It is installed with the model's public ``set_output_embeddings``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.blocks import row_bytes
from ..kernels.q4 import Q4Linear


@dataclass(frozen=True)
class RankedVocab:
    """How many of a ranking's most frequent tokens the draft's head keeps (|S|, e.g. 32768).
    Raises ValueError for a size below 1."""

    size: int

    def __post_init__(self) -> None:
        if not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"a ranked vocabulary keeps at least 1 token, not {self.size!r}; e.g. RankedVocab(32768)")


class RankedHead(torch.nn.Module):
    """y = the head's logits for the tokens ``ids`` [|S|] (ascending), −inf elsewhere: input [..., in_features],
    output [..., out_features] (V, the full vocabulary) in the dtype of ``sub``'s output. ``sub``: a module mapping
    [..., in_features] to [..., |S|] (the rows of S of the head it replaces, in ``ids``' order)."""

    def __init__(self, sub: torch.nn.Module, ids: torch.Tensor, out_features: int) -> None:
        super().__init__()
        self.sub, self.in_features, self.out_features = sub, sub.in_features, out_features
        self.register_buffer("ids", ids)  # [|S|] long

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.sub(x)  # [..., |S|]
        out = torch.full((*y.shape[:-1], self.out_features), float("-inf"), dtype=y.dtype, device=y.device)
        return out.index_copy_(-1, self.ids, y)  # [..., V]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kept={self.ids.numel()}"


def check_ids(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """``ids`` as an ascending long tensor [|S|]. Raises ValueError for ids that are not 1-D, empty, repeated or
    outside [0, ``vocab``)."""
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    if ids.numel() == 0:
        raise ValueError("a ranked head needs at least one token id")
    ids = ids.sort().values
    if ids[0] < 0 or ids[-1] >= vocab:
        raise ValueError(f"token ids must lie in [0, {vocab}) (the head's vocabulary); got {ids[0]}..{ids[-1]}")
    if ids.numel() > 1 and bool((ids[1:] == ids[:-1]).any()):
        raise ValueError("token ids of a ranked head must be distinct")
    return ids


def _q4_rows(head: Q4Linear, ids: torch.Tensor) -> Q4Linear:
    """A ``Q4Linear`` over the rows ``ids`` (ascending) of ``head``: the same blocks, segment by segment."""
    parts, at, first = [], 0, 0
    for kind, n in zip(head.kinds, head.rows.tolist()):
        width = row_bytes(kind, head.in_features)
        rows = head.blocks[at : at + n * width].view(n, width)  # [n, bytes]
        mine = ids[(ids >= first) & (ids < first + n)] - first
        if mine.numel():
            parts.append((kind, rows[mine].clone()))
        at, first = at + n * width, first + n
    bias = None if head.bias is None else head.bias[ids]
    sub = Q4Linear(head.in_features, parts, bias, head.directory)
    sub.dense_rows = head.dense_rows
    return sub


def _dense_rows(head: torch.nn.Linear, ids: torch.Tensor) -> torch.nn.Linear:
    """An ``nn.Linear`` over the rows ``ids`` of ``head``'s weight (and bias), same dtype and device."""
    w = head.weight.detach()
    sub = torch.nn.Linear(head.in_features, ids.numel(), bias=head.bias is not None, dtype=w.dtype, device=w.device)
    with torch.no_grad():
        sub.weight.copy_(w[ids.to(w.device)])
        if head.bias is not None:
            sub.bias.copy_(head.bias.detach()[ids.to(w.device)])
    return sub


def ranked_head(head: torch.nn.Module, ids: torch.Tensor) -> RankedHead:
    """A ``RankedHead`` over the rows ``ids`` (any order; 1-D, distinct, in range) of ``head``, a ``Q4Linear`` or
    an ``nn.Linear``. Raises TypeError for another kind of head (a bitsandbytes or torchao one: load the draft
    in ``q4`` or ``none``); ValueError as ``check_ids``."""
    if not isinstance(head, (Q4Linear, torch.nn.Linear)):
        raise TypeError(
            f"a ranked vocabulary needs the draft's head as a q4 or dense linear layer, not {type(head).__name__}; "
            "load the draft with quantization='q4' or 'none'"
        )
    ids = check_ids(ids, head.out_features)
    sub = _q4_rows(head, ids) if isinstance(head, Q4Linear) else _dense_rows(head, ids)
    device = head.blocks.device if isinstance(head, Q4Linear) else head.weight.device
    return RankedHead(sub, ids.to(device), head.out_features)


def rank_head(model: torch.nn.Module, ids: torch.Tensor) -> torch.nn.Module:
    """``model`` (a causal LM) with its output head replaced by ``ranked_head(head, ids)`` (``set_output_embeddings``),
    in place; returned. Raises ValueError where the head is ranked already; TypeError, ValueError as
    ``ranked_head``."""
    head = model.get_output_embeddings()
    if isinstance(head, RankedHead):
        raise ValueError("the model's head is ranked already; load the model again to rank it differently")
    model.set_output_embeddings(ranked_head(head, ids))
    return model
