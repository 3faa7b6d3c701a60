"""Greedy verification and the residual distribution on hand-built tensors; speculative sampling's
reproducibility; the loop's verification of rows of different k in one step. (That speculative sampling is lossless
is checked, with negative controls, by the chi-square tests in test_invariants.py.)"""

from __future__ import annotations

import pytest
import torch

from hf_adaspec.engine.verification import (
    greedy_verify,
    residual_distribution,
    speculative_sample,
)

pytestmark = pytest.mark.usefixtures("one_thread")
V = 6


def _scores(argmaxes: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """Logits [B, k+1, V] whose argmax at each position is the given token (others random, lower)."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(len(argmaxes), len(argmaxes[0]), vocab, generator=gen)  # [B, k+1, V] in [0, 1)
    for b, row in enumerate(argmaxes):
        for i, tok in enumerate(row):
            scores[b, i, tok] = 5.0
    return scores


def test_greedy_all_accepted_gives_bonus_token():
    accepted, tokens = greedy_verify([[3, 1, 4]], _scores([[3, 1, 4, 7]]))  # k = 3
    assert accepted == [3]
    assert tokens == [7]  # argmax of the last (bonus) position


@pytest.mark.parametrize("mismatch", [0, 1, 2])
def test_greedy_first_mismatch(mismatch):
    target = [3, 1, 4, 7]
    draft = list(target[:3])
    draft[mismatch] = 0  # wrong at `mismatch`; later positions still agree (must not count)
    accepted, tokens = greedy_verify([draft], _scores([target]))
    assert accepted == [mismatch]
    assert tokens == [target[mismatch]]  # the target's correction


def test_greedy_batch_rows_are_independent():
    accepted, tokens = greedy_verify([[2, 5], [2, 6]], _scores([[2, 5, 1], [2, 3, 0]]))  # k = 2
    assert accepted == [2, 1]
    assert tokens == [1, 3]


def test_greedy_rows_of_different_k_read_their_own_columns():
    # row 0 drafts 1 token (its bonus at column 1), row 1 drafts 3; row 0's padded columns 2-3 are never read
    accepted, tokens = greedy_verify([[2], [2, 5, 1]], _scores([[2, 6, 2, 2], [2, 5, 1, 4]]))
    assert accepted == [1, 3]
    assert tokens == [6, 4]


def test_greedy_k0_is_plain_argmax():
    accepted, tokens = greedy_verify([[]], _scores([[4]]))
    assert accepted == [0] and tokens == [4]


def test_residual_distribution():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, V, generator=gen), dim=-1)  # [5, V]
    q = torch.softmax(torch.randn(5, V, generator=gen), dim=-1)  # [5, V]
    r = residual_distribution(p, q)
    assert torch.allclose(r.sum(-1), torch.ones(5))
    assert (r[q >= p] == 0).all() and (r[q < p] > 0).all()
    expected = (p - q).clamp_min(0)
    assert torch.allclose(r, expected / expected.sum(-1, keepdim=True))
    assert torch.equal(residual_distribution(p, p), p)  # p = q: no residual mass → fall back to p


def test_speculative_sample_accepts_a_token_the_target_prefers_and_rejects_one_it_cannot_emit():
    q = torch.full((1, 1, V), 1.0 / V)  # [1, k=1, V] uniform draft
    sure = torch.nn.functional.one_hot(torch.tensor([[2, 5]]), V).float()  # p [1, 2, V]: token 2, then 5
    accepted = speculative_sample(torch.tensor([[2]]), q, sure, torch.Generator().manual_seed(0))
    assert accepted.num_accepted.tolist() == [1] and accepted.next_token.tolist() == [5]  # p/q ≥ 1: bonus from p_2
    rejected = speculative_sample(torch.tensor([[3]]), q, sure, torch.Generator().manual_seed(0))
    assert rejected.num_accepted.tolist() == [0] and rejected.next_token.tolist() == [2]  # p(3) = 0: correction


def test_speculative_sample_is_reproducible_with_generator():
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(1.5 * torch.randn(3, V, generator=gen), dim=-1).expand(100, 3, V)
    q = torch.softmax(1.5 * torch.randn(2, V, generator=gen), dim=-1).expand(100, 2, V)
    draft = torch.multinomial(q[0, 0], 200, replacement=True, generator=gen).view(100, 2)
    a = speculative_sample(draft, q, p, torch.Generator().manual_seed(0))
    b = speculative_sample(draft, q, p, torch.Generator().manual_seed(0))
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
    assert 0 < int(a.num_accepted.sum()) < 200  # not trivially all-accepted or all-rejected


@pytest.mark.parametrize("do_sample", [False, True])
def test_rows_of_different_k_in_one_step_get_their_own_verification(do_sample):
    """The loop verifies every row at once (greedy) or the rows of one k together (``verify_group``, sampling) and
    hands each row its own outcome: rows with k = 2, 0, 1, 2 against targets sure of their tokens (so sampling is
    deterministic here) accept up to their first wrong token and emit the target's token after it."""
    from hf_adaspec.engine.rows import TokenRows
    from hf_adaspec.engine.settings import DecodeSettings
    from hf_adaspec.engine.step_verify import verify_step
    from hf_adaspec.proposers.base import Proposal, Proposals

    sure = [[1, 2, 3], [4, 0, 0], [5, 1, 0], [2, 2, 5]]  # per row the target's token at each position
    logits = 60.0 * torch.nn.functional.one_hot(torch.tensor(sure), V).float()  # [4, k_max+1, V]
    drafts = [[1, 2], [], [0], [2, 3]]  # row 0 all accepted, row 1 plain, row 2 rejected at once, row 3 after one
    proposals = Proposals.of([Proposal(torch.tensor([d], dtype=torch.long).view(1, len(d))) for d in drafts])
    rows = TokenRows.open(torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1), 100, None, 0)
    settings = DecodeSettings([], None, 100, do_sample, generator=torch.Generator().manual_seed(0))
    accepted, new = verify_step(logits, proposals, rows, settings, free=True)
    assert accepted == [2, 0, 0, 1]
    assert new == [[1, 2, 3], [4], [5], [2, 2]]
