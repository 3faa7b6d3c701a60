"""A virtual target and draft for replay: KV caches that answer from traces instead of running a model.

``TraceCache`` has ``RaggedCache``'s interface (``backend.ragged.KVCache``), so the engine's loop and the real
``DraftModelProposer`` run on it unchanged; ``TraceCaches`` makes them for ``engine.run.build_run``. Its
answer at a row's position p depends only on p: the target's next token is the trace's token p + 1 (one-hot
logits; positions after a rejected draft token are never read by greedy verification), the draft's is its
teacher-forced argmax with logits whose softmax gives back the traced q(x). Off the target's path (the draft's
tokens after its first miss) the draft answers as it would on the path, an approximation that moves only where
the confidence stop rule ends a proposal, never what is accepted. Every forward is logged (rows, new columns,
context) for the virtual clock. Token ids are mapped to a small vocabulary per request (``Vocab``) to keep
logits small.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..backend.draft_prefix import PrefixSeed


@dataclass(frozen=True)
class Forward:
    """One logged forward: rows in the batch, new token columns, context (tokens already held, longest row)."""

    batch: int
    columns: int
    context: int


class Vocab:
    """A bijection between the ids a request uses and 0..size-1 (prompt lookup and EOS only compare ids)."""

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = torch.tensor(sorted(set(ids)), dtype=torch.long)  # [V'] original ids, sorted

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def encode(self, ids: Sequence[int]) -> torch.Tensor:
        """[n] original ids (all in the vocabulary) → [n] compact ids."""
        return torch.searchsorted(self.ids, torch.tensor(list(ids), dtype=torch.long))

    def encode_known(self, ids: torch.Tensor) -> torch.Tensor:
        """[n] original ids → [n] compact ids, −1 for an id outside the vocabulary (it matches no token)."""
        at = torch.searchsorted(self.ids, ids).clamp_max(max(self.size - 1, 0))
        return torch.where(self.ids[at] == ids, at, torch.full_like(at, -1)) if self.size else torch.full_like(ids, -1)

    def decode(self, compact: torch.Tensor) -> list[int]:
        return self.ids[compact].tolist()


@dataclass(frozen=True)
class RowAnswers:
    """What a row's model says after each position p (clamped to the last entry): next[p] (compact id) and,
    for a draft, q[p] = its probability (None: the target, one-hot)."""

    next: torch.Tensor  # [P] long
    q: torch.Tensor | None = None  # [P] float


class TraceCache:
    """A ``backend.ragged.KVCache`` for a batch whose rows answer from ``RowAnswers``.

    lengths: [B] long, tokens held per row; ``log``: the forwards, in order; ``cache``: None (no model cache).
    """

    cache = None

    def __init__(self, rows: Sequence[RowAnswers], vocab_size: int, held: Sequence[int] | None = None) -> None:
        self.rows, self.vocab_size = list(rows), vocab_size
        self.lengths = torch.tensor(list(held) if held is not None else [0] * len(rows), dtype=torch.long)
        self.log: list[Forward] = []

    @property
    def batch(self) -> int:
        return len(self.rows)

    def append(self, tokens: torch.Tensor, valid: torch.Tensor, keep: int) -> torch.Tensor:
        """tokens, valid: [B, M] → float32 logits [B, keep, V'] for the block's last ``keep`` columns."""
        positions = self.lengths[:, None] + valid.long().cumsum(dim=1) - 1  # [B, M]
        wanted = positions[:, -keep:].clamp_min(0)  # [B, keep]
        logits = torch.zeros(tokens.shape[0], keep, self.vocab_size)
        for b, row in enumerate(self.rows):
            at = wanted[b].clamp_max(row.next.shape[0] - 1)  # [keep]
            nxt = row.next[at]
            if row.q is not None:  # softmax(logits) puts q on the argmax, the rest spread evenly
                q = row.q[at].clamp(min=2.0 / self.vocab_size, max=1.0 - 1e-6)
                logits[b] = torch.log((1.0 - q) / max(self.vocab_size - 1, 1))[:, None].expand(keep, self.vocab_size)
                logits[b, torch.arange(keep), nxt] = torch.log(q)
            else:
                logits[b, torch.arange(keep), nxt] = 1.0
        self.log.append(Forward(tokens.shape[0], tokens.shape[1], int(self.lengths.max())))
        self.lengths = self.lengths + valid.long().sum(dim=1)
        return logits

    def append_features(self, tokens: torch.Tensor, valid: torch.Tensor, keep: int, layers: tuple[int, ...]
                        ) -> tuple[torch.Tensor, None]:
        """``append``; traces hold no target features, so ``layers`` must be empty (ValueError otherwise)."""
        if layers:
            raise ValueError("traces hold no target features: a draft head cannot be replayed from them")
        return self.append(tokens, valid, keep), None

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep only the first lengths[i] tokens of row i."""
        self.lengths = torch.minimum(self.lengths, lengths)

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` ([b] long)."""
        self.rows = [self.rows[int(i)] for i in rows]
        self.lengths = self.lengths[rows]


class TraceCaches:
    """``engine.run.Caches`` that answer from traces: the target's ``TraceCache`` over ``target`` rows, the
    draft's over ``draft`` rows (holding a seed's prefix length); the caches made are kept for pricing."""

    def __init__(self, target: Sequence[RowAnswers], draft: Sequence[RowAnswers], vocab_size: int) -> None:
        self.target_rows, self.draft_rows, self.vocab_size = list(target), list(draft), vocab_size
        self.made_target: TraceCache | None = None
        self.made_draft: TraceCache | None = None

    def target(self, batch: int) -> TraceCache:
        self.made_target = TraceCache(self.target_rows, self.vocab_size)
        return self.made_target

    def draft(self, batch: int, seed: PrefixSeed | None) -> TraceCache:
        held = [seed.length if seed is not None else 0] * batch
        self.made_draft = TraceCache(self.draft_rows, self.vocab_size, held)
        return self.made_draft


def target_answers(tokens: torch.Tensor, eos: int) -> RowAnswers:
    """The target's next token after every position of compact ``tokens`` [T] (prompt + output); EOS past it."""
    return RowAnswers(torch.cat([tokens[1:], torch.tensor([eos])]))


def draft_answers(prompt_len: int, draft_next: torch.Tensor, draft_q: Sequence[float]) -> RowAnswers:
    """The draft's argmax and q after every position: traced from position prompt_len - 1 on (earlier
    positions, inside the prompt, are never drafted from and repeat the first entry)."""
    head = prompt_len - 1
    nxt = torch.cat([draft_next[:1].expand(head), draft_next])
    q = torch.tensor([draft_q[0]] * head + list(draft_q), dtype=torch.float32)
    return RowAnswers(nxt, q)
