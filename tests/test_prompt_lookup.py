"""Prompt-lookup drafting: n-gram search over the tokens so far."""

from __future__ import annotations

import pytest
import torch

from hf_adaspec.proposers import PromptLookupProposer, Proposal
from hf_adaspec.proposers.prompt_lookup import find_continuation


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


def test_proposer_available_and_propose_shapes():
    ids = _t(1, 2, 3, 4, 5, 1, 2, 3)[None, :]  # [1, 8]
    proposer = PromptLookupProposer(max_ngram=3)
    assert proposer.available(ids, 8) == 5  # 4 5 1 2 3
    assert proposer.available(ids, 2) == 2
    assert proposer.catchup_tokens(ids) == 0
    for k in (1, 2):
        proposal = proposer.propose(ids, k)
        assert isinstance(proposal, Proposal)
        assert proposal.tokens.shape == (1, k) and proposal.k == k and proposal.q is None
        assert proposal.tokens[0].tolist() == [4, 5][:k]


def test_proposer_tracks_growing_sequence():
    proposer = PromptLookupProposer(max_ngram=2)
    ids = _t(1, 2, 3, 1, 2)[None, :]
    assert proposer.propose(ids, 3).tokens.tolist() == [[3, 1, 2]]
    proposer.rollback(5)
    longer = _t(1, 2, 3, 1, 2, 7)[None, :]  # (2,7) and 7 never occurred before
    assert proposer.available(longer, 3) == 0


def test_proposer_no_match():
    ids = _t(1, 2, 3, 4)[None, :]
    assert PromptLookupProposer().available(ids, 8) == 0


@pytest.mark.parametrize("max_ngram, min_ngram", [(0, 0), (2, 3), (3, 0)])
def test_proposer_validation(max_ngram, min_ngram):
    with pytest.raises(ValueError):
        PromptLookupProposer(max_ngram=max_ngram, min_ngram=min_ngram)
