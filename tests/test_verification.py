"""Greedy verification on hand-built logits, and a statistical check that speculative sampling is lossless."""

from __future__ import annotations

import pytest
import torch

import hf_adaspec.verification as verification
from hf_adaspec.verification import greedy_verify, residual_distribution, speculative_sample

pytestmark = pytest.mark.usefixtures("one_thread")
V = 6
B = 200_000
CHI2_CRIT = 20.515  # chi-square critical value, df = V − 1 = 5, p = 0.001


def _scores(argmaxes: list[list[int]], vocab: int = 8) -> torch.Tensor:
    """Logits [B, k+1, V] whose argmax at each position is the given token (others random, lower)."""
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(len(argmaxes), len(argmaxes[0]), vocab, generator=gen)  # [B, k+1, V] in [0, 1)
    for b, row in enumerate(argmaxes):
        for i, tok in enumerate(row):
            scores[b, i, tok] = 5.0
    return scores


def test_greedy_all_accepted_gives_bonus_token():
    draft = torch.tensor([[3, 1, 4]])  # [1, k=3]
    result = greedy_verify(draft, _scores([[3, 1, 4, 7]]))
    assert result.num_accepted.tolist() == [3]
    assert result.next_token.tolist() == [7]  # argmax of the last (bonus) position


@pytest.mark.parametrize("mismatch", [0, 1, 2])
def test_greedy_first_mismatch(mismatch):
    target = [3, 1, 4, 7]
    draft = list(target[:3])
    draft[mismatch] = 0  # wrong at `mismatch`; later positions still agree (must not count)
    result = greedy_verify(torch.tensor([draft]), _scores([target]))
    assert result.num_accepted.tolist() == [mismatch]
    assert result.next_token.tolist() == [target[mismatch]]  # the target's correction


def test_greedy_batch_rows_are_independent():
    draft = torch.tensor([[2, 5], [2, 6]])  # [2, k=2]
    result = greedy_verify(draft, _scores([[2, 5, 1], [2, 3, 0]]))
    assert result.num_accepted.tolist() == [2, 1]
    assert result.next_token.tolist() == [1, 3]
    assert result.num_accepted.dtype == torch.long and result.next_token.shape == (2,)


def test_greedy_k0_is_plain_argmax():
    result = greedy_verify(torch.zeros(1, 0, dtype=torch.long), _scores([[4]]))
    assert result.num_accepted.tolist() == [0] and result.next_token.tolist() == [4]


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


def _chi2(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square of token counts [N] against probabilities [V]."""
    observed = torch.bincount(tokens, minlength=V).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def _problem(k: int, seed: int, one_hot: bool = False):
    """p [k+1, V], q [k, V] (peaked differently so q ≠ p matters) and draft tokens [B, k] sampled from q."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(k + 1, V, generator=gen), dim=-1)
    q = torch.softmax(1.5 * torch.randn(k, V, generator=gen), dim=-1)
    if one_hot:  # deterministic drafter (prompt lookup): always proposes token i % V at position i
        q = torch.nn.functional.one_hot(torch.arange(k) % V, V).float()
    draft = torch.stack([torch.multinomial(q[i].expand(B, V), 1, generator=gen)[:, 0] for i in range(k)], 1)
    return p, q, draft, gen


def _emitted(draft: torch.Tensor, result, position: int) -> torch.Tensor:
    """Token emitted at ``position`` (0 or 1) per row: accepted draft token, else the correction/bonus."""
    n = result.num_accepted
    return torch.where(n > position, draft[:, min(position, draft.shape[1] - 1)], result.next_token)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("one_hot", [False, True])
def test_speculative_sample_first_token_follows_p(k, one_hot):
    p, q, draft, gen = _problem(k, seed=10 + k, one_hot=one_hot)
    result = speculative_sample(draft, q.expand(B, k, V), p.expand(B, k + 1, V), generator=gen)
    assert result.num_accepted.shape == (B,) and int(result.num_accepted.max()) <= k
    assert 0 < float((result.num_accepted > 0).double().mean()) < 1  # both branches exercised
    assert _chi2(_emitted(draft, result, 0), p[0]) < CHI2_CRIT


def test_speculative_sample_second_token_follows_p_given_first_accepted():
    k = 3
    p, q, draft, gen = _problem(k, seed=7)
    result = speculative_sample(draft, q.expand(B, k, V), p.expand(B, k + 1, V), generator=gen)
    kept = result.num_accepted >= 1  # second emitted token is observable in this step
    second = _emitted(draft, result, 1)[kept]
    assert second.numel() > B // 10
    assert _chi2(second, p[1]) < CHI2_CRIT


def test_speculative_sample_all_accepted_bonus_follows_last_p():
    k = 2
    p, _, _, gen = _problem(k, seed=3)
    draft = torch.zeros(B, k, dtype=torch.long)
    q = torch.nn.functional.one_hot(draft[0], V).float()  # [k, V]
    p_accept = p.clone()
    p_accept[:k] = q  # p = q on drafted positions → always accepted
    result = speculative_sample(draft, q.expand(B, k, V), p_accept.expand(B, k + 1, V), generator=gen)
    assert bool((result.num_accepted == k).all())
    assert _chi2(result.next_token, p[k]) < CHI2_CRIT


def test_negative_control_always_accept_fails_chi_square():
    k = 1
    p, q, draft, _ = _problem(k, seed=11)
    assert _chi2(draft[:, 0], p[0]) > 10 * CHI2_CRIT  # emitting the draft token unchecked is detected


def test_negative_control_wrong_residual_fails_chi_square(monkeypatch):
    # a subtle bug: resample from p (not norm(max(0, p − q))) after a rejection → biased towards q
    monkeypatch.setattr(verification, "residual_distribution", lambda p, q: p)
    k = 1
    p, q, draft, gen = _problem(k, seed=11)
    result = speculative_sample(draft, q.expand(B, k, V), p.expand(B, k + 1, V), generator=gen)
    assert _chi2(_emitted(draft, result, 0), p[0]) > 10 * CHI2_CRIT


def test_speculative_sample_is_reproducible_with_generator():
    p, q, draft, _ = _problem(2, seed=5)
    a = speculative_sample(draft[:100], q.expand(100, 2, V), p.expand(100, 3, V), torch.Generator().manual_seed(0))
    b = speculative_sample(draft[:100], q.expand(100, 2, V), p.expand(100, 3, V), torch.Generator().manual_seed(0))
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
