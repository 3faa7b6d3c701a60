"""A virtual target, draft and draft head for replay: caches and a head that answer from traces instead of
running a model.

``TraceCache`` has ``RaggedCache``'s interface (``backend.ragged.KVCache``), so the engine's loop and the real
``DraftModelProposer`` run on it unchanged; ``TraceCaches`` makes them for ``engine.run.build_run``. Its
answer at a row's position p depends only on p: the target's next token is the trace's token p + 1 (one-hot
logits; positions after a rejected draft token are never read by greedy verification), the draft's is its
teacher-forced argmax with logits whose softmax gives back the traced q(x). Off the target's path (the draft's
tokens after its first miss) the draft answers as it would on the path, an approximation that moves only where
the confidence stop rule ends a proposal, never what is accepted. Every forward is logged (rows, new columns,
context) for the virtual clock. Token ids are mapped to a small vocabulary per request (``Vocab``) to keep
logits small.

``VirtualHead`` is an ``Eagle3Head`` (so the mode registry builds the real ``DraftHeadProposer`` on it) whose
"features" and hidden states are bookkeeping: the virtual target's feature at position p of row r is
(r, p, 0); a chain's hidden state is (r, t, d), t the token its first draft predicts and d its depth. It
answers depth d from the trace's head chain (``trace.head_along``: the chain the head drafts, its own tokens
fed back), so it drafts what the head drafts, after a miss too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..backend.caches import open_head_cache
from ..backend.draft_prefix import PrefixSeed
from ..models.eagle3 import Eagle3Head, HeadCache, HeadConfig, HeadKV


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


def peaked_logits(nxt: torch.Tensor, q: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits [n, V'] whose softmax puts q [n] on nxt [n] (compact ids) and the rest evenly on the others
    (q clamped to [2 / V', 1 − 1e-6], so the traced argmax stays the argmax)."""
    q = q.clamp(min=2.0 / vocab_size, max=1.0 - 1e-6)
    logits = torch.log((1.0 - q) / max(vocab_size - 1, 1))[:, None].repeat(1, vocab_size)
    logits[torch.arange(nxt.shape[0]), nxt] = torch.log(q)
    return logits


class TraceCache:
    """A ``backend.ragged.KVCache`` for a batch whose rows answer from ``RowAnswers``.

    lengths: [B] long, tokens held per row; ids: each row's index in the request; ``log``: the forwards, in
    order.
    """

    def __init__(self, rows: Sequence[RowAnswers], vocab_size: int, held: Sequence[int] | None = None) -> None:
        self.rows, self.vocab_size = list(rows), vocab_size
        self.lengths = torch.tensor(list(held) if held is not None else [0] * len(rows), dtype=torch.long)
        self.ids = list(range(len(self.rows)))  # each row's index in the request (rows leave as they finish)
        self.log: list[Forward] = []

    @property
    def batch(self) -> int:
        return len(self.rows)

    def held(self) -> list[int]:
        """Tokens held per row, as ints."""
        return self.lengths.tolist()

    def append(self, tokens: torch.Tensor, valid: torch.Tensor | None, keep: int) -> torch.Tensor:
        """tokens, valid: [B, M] (valid None: every column real) → float32 logits [B, keep, V'] for the block's
        last ``keep`` columns."""
        return self.append_features(tokens, valid, keep, ())[0]

    def append_features(
        self, tokens: torch.Tensor, valid: torch.Tensor | None, keep: int, layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``append``, and with ``layers`` (a ``VirtualHead``'s three) the virtual features of every column,
        [B, M, 3] float32: (the row's index in the request, the column's position, 0); None without layers.
        Raises ValueError for other than three layers (only a virtual head reads these features)."""
        if layers and len(layers) != 3:
            raise ValueError("traces hold no target features: only a VirtualHead (three layers) reads virtual ones")
        if valid is None:
            valid = torch.ones(tokens.shape, dtype=torch.bool)
        positions = self.lengths[:, None] + valid.long().cumsum(dim=1) - 1  # [B, M]
        wanted = positions[:, -keep:].clamp_min(0)  # [B, keep]
        logits = torch.zeros(tokens.shape[0], keep, self.vocab_size)
        for b, row in enumerate(self.rows):
            at = wanted[b].clamp_max(row.next.shape[0] - 1)  # [keep]
            if row.q is not None:
                logits[b] = peaked_logits(row.next[at], row.q[at], self.vocab_size)
            else:
                logits[b, torch.arange(keep), row.next[at]] = 1.0
        features = None
        if layers:
            ids = torch.tensor(self.ids, dtype=torch.float32)[:, None].expand_as(positions)
            features = torch.stack([ids, positions.float(), torch.zeros_like(ids)], dim=-1)  # [B, M, 3]
        self.log.append(Forward(tokens.shape[0], tokens.shape[1], int(self.lengths.max())))
        self.lengths = self.lengths + valid.long().sum(dim=1)
        return logits, features

    def rollback(self, lengths: torch.Tensor) -> None:
        """Keep only the first lengths[i] tokens of row i."""
        self.lengths = torch.minimum(self.lengths, lengths)

    def select(self, rows: torch.Tensor) -> None:
        """Keep batch rows ``rows`` ([b] long)."""
        self.rows = [self.rows[int(i)] for i in rows]
        self.ids = [self.ids[int(i)] for i in rows]
        self.lengths = self.lengths[rows]

    def export_prefix(self) -> None:
        """No model cache to keep: the prefix store keeps the token ids alone."""
        return None


class TraceCaches:
    """``engine.run.Caches`` that answer from traces: the target's ``TraceCache`` over ``target`` rows, the
    draft's over ``draft`` rows (holding a seed's prefix length); the caches made are kept for pricing. The
    ``head``'s entries (a ``VirtualHead``; None: no head) are bookkeeping in a ``HeadCache``."""

    def __init__(
        self,
        target: Sequence[RowAnswers],
        draft: Sequence[RowAnswers],
        vocab_size: int,
        head: VirtualHead | None = None,
    ) -> None:
        self.target_rows, self.draft_rows, self.vocab_size = list(target), list(draft), vocab_size
        self.virtual_head = head
        self.made_target: TraceCache | None = None
        self.made_draft: TraceCache | None = None

    def target(self, batch: int, layers: tuple[int, ...] = ()) -> TraceCache:
        self.made_target = TraceCache(self.target_rows, self.vocab_size)
        return self.made_target

    def draft(self, batch: int, seed: PrefixSeed | None) -> TraceCache:
        held = [seed.length if seed is not None else 0] * batch
        self.made_draft = TraceCache(self.draft_rows, self.vocab_size, held)
        return self.made_draft

    def head(self, batch: int) -> HeadKV:
        if self.virtual_head is None:
            raise ValueError("no draft head to make a cache for")
        return open_head_cache(self.virtual_head, batch)


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


@dataclass(frozen=True)
class HeadAnswers:
    """A row's head chains: next[j, d] (compact id) and q[j, d], the head's d+1-th token drafted after
    tokens[: prompt_len + j] (``trace.Trace.head_next``), j = 0..n, d = 0..depth − 1."""

    prompt_len: int
    next: torch.Tensor  # [n+1, depth] long
    q: torch.Tensor  # [n+1, depth] float


def head_answers(prompt_len: int, head_next: torch.Tensor, head_q: Sequence[Sequence[float]]) -> HeadAnswers:
    """``HeadAnswers`` from a trace's compact head_next [n+1, depth] and its head_q."""
    return HeadAnswers(prompt_len, head_next, torch.tensor(head_q, dtype=torch.float32))


class VirtualHead(Eagle3Head):
    """An ``Eagle3Head`` that answers from traces (module docstring): ``fuse`` passes the virtual features
    (r, p, 0) through; ``step`` maps an entry on the feature at position p to (r, p + 2, 1) and a chained
    entry (r, t, d) to (r, t, d + 1), keeping the cache's entry count; ``logits`` of (r, t, d) answers row
    r's head_next[t − prompt_len][d − 1] with its q (``peaked_logits``; indices clamped to what was traced).
    One object serves every request of a replayed method (``serve`` gives it the request's rows), so what
    the pair learns about it, keyed by its identity, carries across requests as for a real head. ``log``:
    its forwards (rows, columns, entries held before) for the virtual clock."""

    def __init__(self) -> None:
        super().__init__(HeadConfig(3, 1, 1, 1, 1, 1, 1, (0, 0, 0)), nn.Embedding(1, 3))
        self.rows: list[HeadAnswers] = []
        self.vocab_size = 1
        self.log: list[Forward] = []

    def serve(self, rows: Sequence[HeadAnswers], vocab_size: int) -> None:
        """Answer a new request's rows (in request order) over a vocabulary of ``vocab_size``; clear the log."""
        self.rows, self.vocab_size, self.log = list(rows), vocab_size, []

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The virtual features [B, M, 3] as they are (float32)."""
        return features.float()

    def step(self, tokens: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor, cache: HeadCache) -> torch.Tensor:
        """hidden [B, M, 3] → the entries' bookkeeping outputs [B, M, 3]; one entry per valid column of ``cache``."""
        row, at, depth = hidden.float().unbind(-1)
        first = torch.stack([row, at + 2, torch.ones_like(at)], dim=-1)
        out = torch.where((depth == 0)[..., None], first, torch.stack([row, at, depth + 1], dim=-1))
        held = int(cache.lengths.max()) if len(cache.lengths) else 0
        self.log.append(Forward(tokens.shape[0], tokens.shape[1], held))
        empty = torch.zeros(tokens.shape[0], 1, tokens.shape[1], 1)
        cache.add(empty, empty, valid.cpu())
        return out

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [B, 3] → float32 logits [B, V'] putting each chain's traced q on its traced token."""
        nxt, q = [], []
        for r, t, d in hidden.round().long().tolist():
            answers = self.rows[r]
            j = min(max(t - answers.prompt_len, 0), answers.next.shape[0] - 1)
            u = min(max(d - 1, 0), answers.next.shape[1] - 1)
            nxt.append(answers.next[j, u])
            q.append(answers.q[j, u])
        return peaked_logits(torch.stack(nxt), torch.stack(q), self.vocab_size)
