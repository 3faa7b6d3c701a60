"""A batch's proposals flat with offsets (vLLM's cu_num_draft_tokens layout): rows read back as they went in, a
deterministic row's q is its one-hot beside a sampled row's, and merging picks each row from its drafter."""

from __future__ import annotations

import pytest
import torch

from hf_adaspec.proposers import Proposal, Proposals


def test_rows_read_back_from_the_flat_layout():
    q = torch.softmax(torch.randn(1, 2, 8, generator=torch.Generator().manual_seed(0)), -1)  # [1, 2, V]
    rows = [
        Proposal(torch.tensor([[3, 4]]), q, (0.5, 0.25)),
        Proposal(torch.zeros(1, 0, dtype=torch.long)),
        Proposal(torch.tensor([[7]])),
    ]
    flat = Proposals.of(rows)
    assert flat.offsets == (0, 2, 2, 3) and flat.ks == (2, 0, 1) and flat.tokens.tolist() == [3, 4, 7]
    assert flat.rows() == [[3, 4], [], [7]] and len(flat) == 3
    assert torch.equal(flat[0].q, q) and flat[0].confidences == (0.5, 0.25)
    assert flat[1].k == 0 and flat[1].q is None
    assert torch.equal(flat[2].q[0], torch.nn.functional.one_hot(torch.tensor([7]), 8).float())  # deterministic
    assert flat[-1].tokens.tolist() == [[7]]
    with pytest.raises(IndexError):
        flat[3]


def test_merge_takes_each_row_from_the_drafter_it_chose():
    a = Proposals.of([Proposal(torch.tensor([[1, 2]])), Proposal(torch.tensor([[3]]))])
    b = Proposals.of([Proposal(torch.tensor([[9]])), Proposal(torch.tensor([[8, 7, 6]]))])
    assert Proposals.merge([a, b], [1, 0]).rows() == [[9], [3]]
    assert Proposals.merge([a, None], [0, 1]).rows() == [[1, 2], []]  # drafter 1 did not run: a plain row
    assert Proposals.merge([a, b], [0, 0]) is a
    assert Proposals.empty(2).ks == (0, 0)
