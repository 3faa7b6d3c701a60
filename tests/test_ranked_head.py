"""A draft's output head over a ranked subset of the vocabulary (``models.ranked_head``, FR-Spec): logits equal to
the full head's on the subset and −inf elsewhere, for a dense and a q4 head; speculative greedy output unchanged;
bad ids refused. Sampling with a ranked draft is checked lossless in ``test_invariants`` (the "ranked_copy" case)."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_adaspec.kernels.q4_layer import Q4Linear
from hf_adaspec.models.ranked_head import RankedHead, head_rows, rank_output_head

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
IDS = torch.tensor([5, 0, 63, 17, 40, 41, 2])  # any order: the head's rows follow it


@pytest.mark.parametrize("kind", ["dense", "q4"])
def test_ranked_logits_are_the_full_heads_on_the_subset_and_minus_inf_elsewhere(kind, kernel_dir):
    torch.manual_seed(0)
    head = torch.nn.Linear(64, 64, bias=True).requires_grad_(False)
    if kind == "q4":
        head = Q4Linear.dense(head, kernel_dir)
    ranked = RankedHead(head_rows(head, IDS), IDS, 64)
    x = torch.randn(2, 3, 64)
    full, got = head(x), ranked(x)  # [2, 3, 64] each
    assert got.shape == (2, 3, 64) and ranked.out_features == 64 and ranked.in_features == 64
    if kind == "q4":  # the kernel computes each row alone: the same bits
        assert torch.equal(got[..., IDS], full[..., IDS])
    else:  # torch's matmul may block 7 rows otherwise than 64: the last bits may differ
        torch.testing.assert_close(got[..., IDS], full[..., IDS], rtol=1e-5, atol=1e-6)
    outside = torch.ones(64, dtype=torch.bool)
    outside[IDS] = False
    assert bool(torch.isneginf(got[..., outside]).all())


def test_speculative_greedy_with_a_ranked_draft_equals_plain_greedy(models):
    target = models["target"]
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6]])
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    draft = rank_output_head(copy.deepcopy(models["noisy_copy"]), torch.arange(0, 64, 2))  # the even ids
    out = target.generate(
        prompt,
        assistant_model=draft,
        speculation="fixed",
        num_speculative_tokens=3,
        max_new_tokens=24,
        return_dict_in_generate=True,
    )
    assert torch.equal(out.sequences, plain)
    drafted = [s for s in out.speculation.steps if s.drafter == "draft_model" and s.k]
    assert drafted and any(s.accepted for s in drafted)  # it proposed, and some proposals were taken


def test_bad_ids_and_heads_are_refused(models):
    head = torch.nn.Linear(8, 16)
    with pytest.raises(ValueError, match="unique vocabulary ids"):
        RankedHead(head_rows(head, torch.tensor([1, 1])), torch.tensor([1, 1]), 16)
    with pytest.raises(ValueError, match="one per row"):
        RankedHead(head_rows(head, torch.tensor([1, 2])), torch.tensor([1, 2, 3]), 16)
    with pytest.raises(ValueError, match="nn.Linear or Q4Linear"):
        head_rows(torch.nn.Identity(), torch.tensor([0]))
    ranked = rank_output_head(copy.deepcopy(models["other_seed"]), torch.arange(8))
    with pytest.raises(ValueError, match="already ranked"):
        rank_output_head(ranked, torch.arange(4))
