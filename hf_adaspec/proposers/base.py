"""The drafter interface: three calls per step, none depending on another's leftovers.

Each step the engine asks every drafter for its ``offer`` (what it could propose for each row, before
anything is paid), the controller decides, each chosen drafter ``propose``s for the rows that picked it,
the target verifies, and every drafter ``commit``s (keeps what was confirmed, drops rows that finished).

- A *costless* drafter (prompt lookup, suffix drafting) drafts without a forward: its offer already holds
  the tokens it would propose, so its proposal is a cut of the offer (``CostlessDrafter``) and hindsight
  scores the offer against the emitted tokens. It keeps no state between calls.
- A *paid* drafter (the draft model) offers only a length bound, the columns it must catch up and
  evidence; its tokens cost forwards, so they come from ``propose``, which may ask a ``StopRule`` after
  each column. It keeps its own KV cache, rolled back per row by ``commit``.

Notation: q = draft distribution. A deterministic drafter returns ``q=None``, which verification treats
as one-hot on its tokens. Rows are kept as ``Rows``: each row's padded view (its left padding, prompt and
generated tokens, which is what logits processors and stopping criteria see, as in transformers'
batched generate) and where its real tokens start. A single request is a batch of one row.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class Proposal:
    """One row's draft tokens [1, k] long and, for sampling, their draft probabilities q [1, k, V] (else
    None); ``confidences``: q(x_u) of each drafted token (empty for deterministic drafters)."""

    tokens: torch.Tensor
    q: torch.Tensor | None = None
    confidences: tuple[float, ...] = ()

    @property
    def k(self) -> int:
        """Proposal length (tokens)."""
        return self.tokens.shape[1]


@dataclass(frozen=True)
class Proposals(Sequence[Proposal]):
    """A batch's proposals, flat (vLLM's layout): ``tokens`` [Σ k_i] long on the host, row after row;
    ``offsets`` [b + 1]: row i's tokens are ``tokens[offsets[i] : offsets[i + 1]]`` (``cu_num_draft_tokens``);
    ``q`` [Σ k_i, V]: the draft probabilities of every token when sampling (a deterministic row's one-hot; None
    when no row has any); ``confidences``: per row q(x_u) of its tokens (empty: none given). Indexing gives row
    i as a ``Proposal``."""

    tokens: torch.Tensor
    offsets: tuple[int, ...]
    q: torch.Tensor | None = None
    confidences: tuple[tuple[float, ...], ...] = ()

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Proposal:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(f"row {i} of {len(self)}")
        i %= len(self)
        a, b = self.offsets[i], self.offsets[i + 1]
        return Proposal(
            self.tokens[a:b][None],
            None if self.q is None or a == b else self.q[a:b][None],
            self.confidences[i] if self.confidences else (),
        )

    @property
    def ks(self) -> tuple[int, ...]:
        """Proposal length per row (tokens)."""
        return tuple(b - a for a, b in zip(self.offsets, self.offsets[1:]))

    def rows(self) -> list[list[int]]:
        """Each row's token ids (one host read of the flat tokens)."""
        flat = self.tokens.tolist()
        return [flat[a:b] for a, b in zip(self.offsets, self.offsets[1:])]

    @classmethod
    def empty(cls, batch: int) -> Proposals:
        """``batch`` rows of k = 0 (a plain step; one shared value per batch size: nothing in it changes)."""
        return _empty(batch)

    @classmethod
    def of(cls, rows: Sequence[Proposal]) -> Proposals:
        """The flat form of per-row proposals (q: a row without q gets its tokens' one-hot where another has q)."""
        offsets = [0]
        for row in rows:
            offsets.append(offsets[-1] + row.k)
        tokens = torch.cat([row.tokens[0] for row in rows]) if offsets[-1] else torch.zeros(0, dtype=torch.long)
        with_q = [row.q for row in rows if row.q is not None]
        q = None
        if with_q:
            vocab = with_q[0].shape[-1]
            q = torch.cat(
                [
                    row.q[0].cpu()
                    if row.q is not None
                    else torch.nn.functional.one_hot(row.tokens[0], vocab).to(with_q[0].dtype)
                    for row in rows
                ]
            )
        confidences = tuple(row.confidences for row in rows) if any(row.confidences for row in rows) else ()
        return cls(tokens, tuple(offsets), q, confidences)

    @classmethod
    def merge(cls, parts: Sequence[Proposals | None], chosen: Sequence[int]) -> Proposals:
        """Row i of ``parts[chosen[i]]`` for every row (a None part: that drafter did not run; its rows are
        plain)."""
        if len(set(chosen)) == 1 and parts[chosen[0]] is not None:  # every row from one drafter
            return parts[chosen[0]]
        empty = Proposal(torch.zeros(1, 0, dtype=torch.long))
        return cls.of([empty if parts[d] is None else parts[d][i] for i, d in enumerate(chosen)])


@functools.lru_cache(maxsize=64)
def _empty(batch: int) -> Proposals:
    return Proposals(torch.zeros(0, dtype=torch.long), (0,) * (batch + 1))


@dataclass(frozen=True)
class Rows:
    """views: per row a [T_i] long tensor (left padding + tokens); starts: per row its padding length;
    prompt_width: the padded prompt's width T (row i's prompt holds T − starts[i] real tokens)."""

    views: tuple[torch.Tensor, ...]
    starts: tuple[int, ...]
    prompt_width: int

    def tokens(self, i: int) -> torch.Tensor:
        """Row i's real tokens (prompt + generated), [n_i] long."""
        return self.views[i][self.starts[i] :]

    def prompt_length(self, i: int) -> int:
        """Row i's real prompt tokens."""
        return self.prompt_width - self.starts[i]

    @property
    def lengths(self) -> torch.Tensor:
        """Real tokens per row, [B] long."""
        return torch.tensor([v.shape[0] - s for v, s in zip(self.views, self.starts, strict=True)])


@dataclass(frozen=True)
class DraftOffer:
    """What a drafter can propose for each of B rows now, before anything is paid.

    bounds[i]: the most tokens it can draft for row i (≤ the step's k_max); evidence[i]: what predicts
    their acceptance (the match length of a costless drafter's proposal; 0 where there is none); catchup:
    columns beyond steady state a paid drafter must ingest before its first token (prompts, runs of plain
    steps); tokens: a costless drafter's proposal per row, [bounds[i]] long (None for a paid drafter).
    """

    bounds: tuple[int, ...]
    evidence: tuple[int, ...]
    catchup: int = 0
    tokens: tuple[torch.Tensor, ...] | None = None

    @property
    def costless(self) -> bool:
        """Whether the offer holds its tokens (drafted without a forward, so hindsight can score them)."""
        return self.tokens is not None

    def take(self, ks: Sequence[int]) -> Proposals:
        """Row i's first ks[i] offered tokens as the proposals. Raises ValueError for a paid offer."""
        if self.tokens is None:
            raise ValueError("a paid drafter's offer holds no tokens; its proposal comes from propose()")
        return Proposals.of([Proposal(tokens=t[:k][None, :]) for t, k in zip(self.tokens, ks, strict=True)])


StopRule = Callable[[int, Sequence[tuple[float, ...]], Sequence[bool]], bool]
"""stop(j, confidences, growing) → True to end drafting after j columns: per row its confidences so far
(q(x_u) of its kept tokens) and whether it could take one more token."""


class Drafter(Protocol):
    """What the engine needs from a drafter (``name``: how ``StepRecord.drafter`` reports its steps)."""

    name: str

    def offer(self, rows: Rows, k_max: int) -> DraftOffer:
        """What it can propose for every row now (at most k_max tokens each)."""
        ...

    def propose(self, rows: Rows, offer: DraftOffer, ks: Sequence[int], stop: StopRule | None = None) -> Proposals:
        """Row i's proposal of up to ks[i] ≤ offer.bounds[i] tokens (q when sampling; ks[i] = 0 for rows that
        did not pick this drafter), flat. A drafter with confidences asks ``stop`` after each drafted column."""
        ...

    def commit(
        self, lengths: torch.Tensor, keep: torch.Tensor | None = None, features: list[torch.Tensor] | None = None
    ) -> None:
        """The first lengths[i] ([B] long) tokens of row i are confirmed: forget state past them; then keep
        only rows ``keep`` ([b] long indices; None: all). ``features``: where the run records the target's
        features (a draft head reads them), per row those of the positions the step confirmed, [c_i, F]."""
        ...


class CostlessDrafter(ABC):
    """Base of drafters without a forward or state: a subclass implements ``offer`` (with its tokens);
    the proposal is a cut of the offer and there is nothing to commit."""

    name: str

    @abstractmethod
    def offer(self, rows: Rows, k_max: int) -> DraftOffer:
        """Per row the tokens it proposes now (``DraftOffer.tokens``), at most k_max each."""

    def propose(self, rows: Rows, offer: DraftOffer, ks: Sequence[int], stop: StopRule | None = None) -> Proposals:
        """The offer's first ks[i] tokens per row; ``stop`` is not asked (no confidences, nothing to save)."""
        return offer.take(ks)

    def commit(  # noqa: B027 - a no-op on purpose: a costless drafter keeps no state to commit
        self, lengths: torch.Tensor, keep: torch.Tensor | None = None, features: list[torch.Tensor] | None = None
    ) -> None:
        """No state across steps."""
