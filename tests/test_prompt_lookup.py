"""Prompt-lookup drafting: n-gram search over the tokens so far."""

from __future__ import annotations

import pytest
import torch
from conftest import slow_except

from hf_adaspec.proposers import DraftOffer, PromptLookupProposer, Proposal
from hf_adaspec.proposers.base import Rows
from hf_adaspec.proposers.prompt_lookup import find_continuation, find_match


def _t(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.long)


def test_continuation_after_most_recent_match():
    tokens = _t(1, 2, 3, 4, 1, 2, 3, 5, 9, 1, 2, 3)  # last 3-gram (1,2,3) occurs at 0 and at 4
    assert find_continuation(tokens, 3, 1, 10).tolist() == [5, 9, 1, 2, 3]  # after the later one


def test_respects_k_max():
    tokens = _t(1, 2, 3, 4, 1, 2, 3, 5, 9, 1, 2, 3)
    assert find_continuation(tokens, 3, 1, 2).tolist() == [5, 9]
    assert find_continuation(tokens, 3, 1, 1).tolist() == [5]
    assert find_continuation(tokens, 3, 1, 0).tolist() == []


def test_longest_ngram_wins_over_more_recent_shorter_match():
    tokens = _t(1, 2, 3, 10, 5, 3, 11, 1, 2, 3)  # (1,2,3) at 0; the 1-gram (3) last at 5
    assert find_continuation(tokens, 3, 1, 3).tolist() == [10, 5, 3]
    assert find_continuation(tokens, 1, 1, 3).tolist() == [11, 1, 2]  # unigram only: most recent 3


def test_falls_back_to_shorter_ngrams():
    tokens = _t(7, 4, 8, 9, 6, 4)  # no earlier (9,6,4) or (6,4); unigram 4 at 1
    assert find_continuation(tokens, 3, 1, 4).tolist() == [8, 9, 6, 4]
    assert find_continuation(tokens, 3, 2, 4).tolist() == []  # min_ngram=2 forbids the unigram


@pytest.mark.parametrize("tokens", [(1, 2, 3, 4), (5,), (1, 2)])
def test_no_match_returns_empty(tokens):
    out = find_continuation(_t(*tokens), 3, 1, 5)
    assert out.shape == (0,) and out.dtype == torch.long


def test_continuation_never_includes_the_query_itself():
    tokens = _t(4, 4, 4)  # last 2-gram (4,4) first occurs at 0 → continuation from 2
    assert find_continuation(tokens, 2, 1, 5).tolist() == [4]


def _every_ngram(tokens: torch.Tensor, max_ngram: int, min_ngram: int, k_max: int) -> tuple[list[int], int]:
    """The reference search: for n = max_ngram … min_ngram, every earlier n-gram with a successor compared
    with the last n tokens; the most recent hit of the first n with one, and its match length (≤ 32)."""
    ids = tokens.tolist()
    for n in range(min(max_ngram, len(ids) - 1), min_ngram - 1, -1):
        hits = [e for e in range(n - 1, len(ids) - 1) if ids[e - n + 1 : e + 1] == ids[-n:]]
        if hits:
            m = 0
            while m < min(32, hits[-1] + 1) and ids[hits[-1] - m] == ids[-1 - m]:
                m += 1
            return ids[hits[-1] + 1 : hits[-1] + 1 + k_max], m
    return [], 0


@pytest.mark.parametrize("seed", slow_except(range(4), fast={0}))  # make test runs every seed
def test_one_pass_search_finds_what_every_ngram_finds(seed):
    """The search by reach (every earlier end of the last token at once) against trying every n: the same
    continuation and match length, on random sequences of few distinct tokens (long and repeated matches)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(200):
        length, alphabet = int(torch.randint(1, 90, (1,), generator=gen)), int(torch.randint(1, 5, (1,), generator=gen))
        tokens = torch.randint(0, alphabet, (length,), generator=gen)
        max_ngram = int(torch.randint(1, 40, (1,), generator=gen))
        min_ngram = int(torch.randint(1, max_ngram + 1, (1,), generator=gen))
        k_max = int(torch.randint(0, 9, (1,), generator=gen))
        continuation, m = find_match(tokens, max_ngram, min_ngram, k_max)
        assert (continuation.tolist(), m) == _every_ngram(tokens, max_ngram, min_ngram, k_max)


def _rows(*rows: tuple[int, ...], pad: int = 0) -> Rows:
    """Left-padded rows as the engine keeps them: each row's padded view and its padding length."""
    width = max(len(r) for r in rows)
    return Rows(
        tuple(_t(*([pad] * (width - len(r)) + list(r))) for r in rows),
        tuple(width - len(r) for r in rows),
        prompt_width=width,
    )


def test_proposer_offer_and_propose_shapes():
    rows = _rows((1, 2, 3, 4, 5, 1, 2, 3))
    proposer = PromptLookupProposer(max_ngram=3)
    offer = proposer.offer(rows, 8)
    assert offer.bounds == (5,) and offer.costless and offer.catchup == 0  # 4 5 1 2 3
    assert offer.evidence == (3,) and offer.tokens[0].tolist() == [4, 5, 1, 2, 3]  # matched 1 2 3
    assert proposer.offer(rows, 2).bounds == (2,)
    for k in (1, 2):
        (proposal,) = proposer.propose(rows, offer, [k])
        assert isinstance(proposal, Proposal)
        assert proposal.tokens.shape == (1, k) and proposal.k == k and proposal.q is None
        assert proposal.tokens[0].tolist() == [4, 5][:k] and proposal.confidences == ()


def test_proposer_rows_search_only_their_own_tokens():
    # rows 1 and 2 are left-padded with the pad id 0: row 2's last token 0 would match the padding, but
    # its own tokens hold no earlier 0
    rows = _rows((1, 2, 3, 4, 5, 1, 2, 3), (7, 8, 9, 7, 8), (3, 0))
    proposer = PromptLookupProposer(max_ngram=3)
    assert proposer.offer(rows, 8).bounds == (5, 3, 0)
    offer = proposer.offer(rows, 2)
    assert offer.bounds == (2, 2, 0)
    proposals = proposer.propose(rows, offer, [1, 2, 0])  # a row may take fewer than it was offered, or none
    assert [p.tokens[0].tolist() for p in proposals] == [[4], [9, 7], []]
    assert [p.k for p in proposals] == [1, 2, 0]


def test_proposer_offers_from_the_rows_alone():
    proposer = PromptLookupProposer(max_ngram=2)
    rows = _rows((1, 2, 3, 1, 2))
    offer = proposer.offer(rows, 3)
    assert offer.bounds == (3,) and proposer.propose(rows, offer, [3])[0].tokens.tolist() == [[3, 1, 2]]
    proposer.commit(torch.tensor([5]))
    longer = _rows((1, 2, 3, 1, 2, 7))  # (2,7) and 7 never occurred before
    assert proposer.offer(longer, 3).bounds == (0,)
    assert proposer.offer(rows, 3).tokens[0].tolist() == [3, 1, 2]  # no state carried between calls


def test_proposer_no_match():
    offer = PromptLookupProposer().offer(_rows((1, 2, 3, 4)), 8)
    assert offer.bounds == (0,) and offer.evidence == (0,) and offer.tokens[0].shape == (0,)


def test_a_paid_offer_holds_no_tokens_to_take():
    with pytest.raises(ValueError, match="propose"):
        DraftOffer((3,), (0,)).take([2])


@pytest.mark.parametrize("max_ngram, min_ngram", [(0, 0), (2, 3), (3, 0)])
def test_proposer_validation(max_ngram, min_ngram):
    with pytest.raises(ValueError):
        PromptLookupProposer(max_ngram=max_ngram, min_ngram=min_ngram)
