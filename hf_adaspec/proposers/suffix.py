"""Suffix drafting: the most frequent continuation of the sequence's longest matching suffix, found in the
current request and in the responses of earlier requests (a cross-request, costless drafter).

SuffixDecoding (Oliaro et al., arXiv 2411.04975), as implemented by arctic-inference's
``SuffixDecodingCache`` (vLLM's ``suffix`` speculative method): a "local" suffix tree over the request's
prompt and output so far and a "global" one over earlier responses (plus the current one), both of depth
``max_depth``. For every match length L = 1..(context − 1) the node of the context's last L tokens is
found; from it the path of most frequent children is followed, each token's probability the product of
child count / parent count along the path, while it is ≥ ``min_token_prob``, for at most
min(k, ⌊L·spec_factor + spec_offset⌋, max_depth − L) tokens; the draft's score is the sum of its
probabilities and the best-scoring (L, tree) wins (ties: the longer match, then the local tree).

Here the trees are not built: a node of a depth-bounded suffix trie is a string w (|w| ≤ max_depth) and
its count the number of occurrences of w, so the same quantities come from scanning the token arrays
(numpy) for the occurrences of the context's suffix, narrowing them as L grows and as the path extends.
Arctic's counts include the context's own occurrence (the current output is in both trees), and so do
these; ties between children of equal count follow arctic's sibling order (``_top_child``). Checked
against arctic-inference 0.3.0's compiled tree on the Spec-Bench traces (the decision's replay script,
``benchmarks/suffix_replay.py`` at commit 6a91d7e). The search runs from the longest match down and skips
what cannot win (``speculate``): the same draft as trying every L, for a fraction of the work on every step.

The offer carries its match length L as ``evidence``, so the controller prices it with the same
``policy.match.MatchTable`` as prompt lookup (a table of its own, learned by hindsight every step).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .base import CostlessDrafter, DraftOffer, Rows

# vLLM's defaults for its ``suffix`` method (SpeculativeConfig.suffix_decoding_*)
SUFFIX_MAX_DEPTH = 24
SUFFIX_SPEC_FACTOR = 1.0
SUFFIX_SPEC_OFFSET = 0.0
SUFFIX_MIN_TOKEN_PROB = 0.1

SEPARATOR = -1  # between sequences in a buffer: no match or continuation crosses it


@dataclass(frozen=True)
class SuffixDraft:
    """A draft: its tokens, each token's estimated probability, their sum (score) and the match length."""

    tokens: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    score: float = 0.0
    match_len: int = 0


SMALL_NODE = 48  # a node with at most this many occurrences counts its children in Python (no sort)


def _top_child(follow: np.ndarray) -> tuple[int, int]:
    """The most frequent token of ``follow`` (in insertion order) and its count. Ties as arctic's sibling
    order has them: at count 1 the child inserted first, at count c > 1 the child that reached c last."""
    if follow.size > SMALL_NODE:
        values, counts = np.unique(follow, return_counts=True)
        top = int(counts.max())
        tied = values[counts == top]
        if tied.size == 1:
            return int(tied[0]), top
        reached = [int(np.flatnonzero(follow == v)[top - 1]) for v in tied]  # when each reached the top count
        pick = int(np.argmin(reached)) if top == 1 else int(np.argmax(reached))
        return int(tied[pick]), top
    counts: dict[int, int] = {}
    last: dict[int, int] = {}  # where each token reached its count
    for i, token in enumerate(follow.tolist()):
        counts[token] = counts.get(token, 0) + 1
        last[token] = i
    top = max(counts.values())
    tied = [token for token, count in counts.items() if count == top]  # in insertion order
    return (tied[0] if top == 1 else max(tied, key=last.__getitem__)), top


def _path(buf: np.ndarray, ends: np.ndarray, max_tokens: int, min_prob: float, floor: float = 0.0) -> SuffixDraft:
    """Most-frequent-child path from the node whose occurrences end at positions ``ends`` of ``buf``; empty
    as soon as its score cannot exceed ``floor`` (a token's probability never exceeds its predecessor's, so
    the score is at most the sum so far plus the last probability per token still allowed)."""
    tokens, probs, prob, score = [], [], 1.0, 0.0
    n = buf.shape[0]
    while len(tokens) < max_tokens and ends.size:
        if ends.size == 1:  # one occurrence: what follows it, every token at the same probability (count 1 of 1)
            run = buf[int(ends[0]) + 1 : int(ends[0]) + 1 + max_tokens - len(tokens)]
            cut = (run == SEPARATOR).nonzero()[0]
            run = run[: cut[0]] if cut.size else run
            if prob < min_prob or not run.size:
                break
            if score + prob * (max_tokens - len(tokens)) + 1e-9 <= floor:
                return SuffixDraft()
            tokens, probs = tokens + run.tolist(), probs + [prob] * run.size
            break
        nxt = ends + 1
        nxt = nxt[nxt < n]
        follow = buf[nxt]
        keep = follow != SEPARATOR
        nxt, follow = nxt[keep], follow[keep]
        if not follow.size:
            break
        token, count = _top_child(follow)
        prob *= count / ends.size
        if prob < min_prob:
            break
        score += prob
        if score + prob * (max_tokens - len(tokens) - 1) + 1e-9 <= floor:
            return SuffixDraft()
        tokens.append(token)
        probs.append(prob)
        ends = nxt[follow == token]
    return SuffixDraft(tuple(tokens), tuple(probs), float(sum(probs)))


def _occurrences(buf: np.ndarray, context: np.ndarray) -> list[np.ndarray]:
    """[L-1] → the positions of ``buf`` where the context's last L tokens end, for L = 1 … until none is
    left but (at most) buf's last position, which nothing continues (or L = C − 1). buf, context: [N], [C]
    int64."""
    out: list[np.ndarray] = []
    ends = (buf == context[-1]).nonzero()[0] if context.size else np.empty(0, dtype=np.int64)  # [n] ascending
    for length in range(1, context.shape[0]):
        if length > 1:
            ends = ends[ends >= length - 1]
            ends = ends[buf[ends - (length - 1)] == context[-length]]
        if not ends.size or (ends.size == 1 and ends[0] == buf.shape[0] - 1):
            break
        out.append(ends)
    return out


def speculate(
    buf: np.ndarray,
    context: np.ndarray,
    max_tokens: int,
    max_depth: int = SUFFIX_MAX_DEPTH,
    spec_factor: float = SUFFIX_SPEC_FACTOR,
    spec_offset: float = SUFFIX_SPEC_OFFSET,
    min_token_prob: float = SUFFIX_MIN_TOKEN_PROB,
    floor: float = 0.0,
) -> SuffixDraft:
    """The best-scoring draft continuing ``context`` from the depth-``max_depth`` suffix trie of ``buf``
    (sequences separated by ``SEPARATOR``), ties to the longer match; only a draft scoring above ``floor``
    counts. buf, context: [N], [C] int64 → ``SuffixDraft`` (empty: no match, or none above ``floor``).

    Longest match first: a draft is at most as long as its cap, and each probability is at most 1, so a
    match whose cap does not exceed the best score so far cannot win and is not followed; nor is a match
    with the same occurrences as the one a token longer (the same node's path, cut shorter) unless its cap
    is larger."""
    best, longer = SuffixDraft(score=floor), (0, 0)  # (occurrences, cap) of the match one token longer
    occurrences = _occurrences(buf, context[-max_depth:])
    for length in range(len(occurrences), 0, -1):
        cap = min(max_tokens, int(length * spec_factor + spec_offset + 1e-6), max_depth - length)
        ends, same = occurrences[length - 1], longer[0] == occurrences[length - 1].size and cap <= longer[1]
        longer = (ends.size, cap)
        if cap <= best.score or same:  # same: the longer match's node, so a prefix of its path
            continue
        draft = _path(buf, ends, cap, min_token_prob, best.score)
        if draft.score > best.score:
            best = SuffixDraft(draft.tokens, draft.probs, draft.score, length)
    return best if best.tokens else SuffixDraft()


class SuffixMemory:
    """The responses (and, with ``prompts``, the prompts) of the last requests, first in first out, at most
    ``max_requests`` of them and ``max_tokens`` tokens: the global tree's sequences. Kept across requests
    in the pair's learned state; token ids are the target tokenizer's."""

    def __init__(self, max_requests: int = 256, max_tokens: int = 1 << 16, prompts: bool = False) -> None:
        if max_requests < 0 or max_tokens < 0:
            raise ValueError(f"need max_requests, max_tokens >= 0; got {max_requests}, {max_tokens}")
        self.max_requests, self.max_tokens, self.prompts = max_requests, max_tokens, prompts
        self.sequences: deque[np.ndarray] = deque()
        self._tokens = 0
        self._buffer: np.ndarray | None = None

    def remember(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Keep a finished request (its output; with ``prompts`` its prompt as a sequence of its own)."""
        for seq in ([prompt] if self.prompts else []) + [output]:
            arr = np.asarray(list(seq), dtype=np.int64)[-self.max_tokens :] if self.max_tokens else None
            if arr is None or not arr.size or not self.max_requests:
                continue
            self.sequences.append(arr)
            self._tokens += arr.size
        while self.sequences and (
            len(self.sequences) > self.max_requests * (2 if self.prompts else 1) or self._tokens > self.max_tokens
        ):
            self._tokens -= self.sequences.popleft().size
        self._buffer = None

    @property
    def tokens(self) -> int:
        return self._tokens

    def ids(self) -> list[int]:
        """Every distinct token id held."""
        buf = self.buffer()
        return np.unique(buf[buf != SEPARATOR]).tolist()

    def mapped(self, encode: Callable[[np.ndarray], np.ndarray]) -> SuffixMemory:
        """A copy with every sequence's ids ``encode``d (the replay's per-request compact ids)."""
        out = SuffixMemory(self.max_requests, self.max_tokens, self.prompts)
        out.sequences = deque(np.asarray(encode(s), dtype=np.int64) for s in self.sequences)
        out._tokens = self._tokens
        return out

    def buffer(self) -> np.ndarray:
        """Every kept sequence followed by a separator, [N] int64."""
        if self._buffer is None:
            parts = [p for s in self.sequences for p in (s, np.array([SEPARATOR], dtype=np.int64))]
            self._buffer = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
        return self._buffer


def best_draft(
    memory: SuffixMemory,
    tokens: torch.Tensor,
    prompt_length: int,
    k_max: int,
    max_depth: int = SUFFIX_MAX_DEPTH,
    spec_factor: float = SUFFIX_SPEC_FACTOR,
    spec_offset: float = SUFFIX_SPEC_OFFSET,
    min_token_prob: float = SUFFIX_MIN_TOKEN_PROB,
) -> SuffixDraft:
    """A row's best draft of at most k_max tokens: the better of the local tree (the row's own tokens
    [T] long, prompt + output so far) and the global one (``memory``'s sequences plus the row's output)."""
    row = tokens.numpy().astype(np.int64, copy=False)
    context = row[-max_depth:]
    args = (k_max, max_depth, spec_factor, spec_offset, min_token_prob)
    local = speculate(row, context, *args)
    glob = speculate(np.concatenate([memory.buffer(), row[prompt_length:]]), context, *args, floor=local.score)
    return glob if glob.tokens else local  # the global draft only where it scores above the local one


class SuffixProposer(CostlessDrafter):
    """Per row the best suffix draft (``best_draft``) over the row and the pair's ``memory``; q=None
    (deterministic drafter). The memory changes between requests only."""

    name = "suffix"

    def __init__(
        self,
        memory: SuffixMemory,
        max_depth: int = SUFFIX_MAX_DEPTH,
        spec_factor: float = SUFFIX_SPEC_FACTOR,
        spec_offset: float = SUFFIX_SPEC_OFFSET,
        min_token_prob: float = SUFFIX_MIN_TOKEN_PROB,
    ) -> None:
        """Raises ValueError for max_depth < 2."""
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.memory = memory
        self.max_depth, self.spec_factor, self.spec_offset = max_depth, spec_factor, spec_offset
        self.min_token_prob = min_token_prob

    def offer(self, rows: Rows, k_max: int) -> DraftOffer:
        """Per row its best draft ([u_i] long, u_i ≤ k_max; empty if none) and, as evidence, its match length."""
        drafts = [
            best_draft(
                self.memory,
                rows.tokens(i),
                rows.prompt_length(i),
                k_max,
                self.max_depth,
                self.spec_factor,
                self.spec_offset,
                self.min_token_prob,
            )
            for i in range(len(rows.views))
        ]
        return DraftOffer(
            tuple(len(d.tokens) for d in drafts),
            tuple(d.match_len if d.tokens else 0 for d in drafts),
            tokens=tuple(
                torch.tensor(d.tokens, dtype=torch.long) if d.tokens else rows.views[i][:0]
                for i, d in enumerate(drafts)
            ),
        )
