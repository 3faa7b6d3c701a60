"""A draft head over a ranked vocabulary (FR-Spec, ``models.ranked_head``) and its ranking (``models.vocab_rank``):
logits inside S are the full head's, outside S never chosen (q zero there), speculative greedy output with a ranked
draft is the target's plain greedy output, and a ranking that cannot be used says why and how to make one."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import build_tiny_tokenizer

from hf_adaspec import SpeculationState
from hf_adaspec.costs.table import CostTable
from hf_adaspec.kernels import q4
from hf_adaspec.kernels.blocks import quantize_q4_k, quantize_q8_0
from hf_adaspec.models import vocab_rank
from hf_adaspec.models.ranked_head import RankedHead, RankedVocab, rank_head, ranked_head
from hf_adaspec.proposers.chain import Sampler

IDS = torch.tensor([40, 3, 7, 0, 21, 63, 12])  # S, in ranked (not ascending) order


def _outside(v: int, ids: torch.Tensor) -> torch.Tensor:
    keep = torch.ones(v, dtype=torch.bool)
    keep[ids] = False
    return keep


def test_a_dense_heads_logits_inside_s_are_the_full_heads_and_minus_inf_outside():
    torch.manual_seed(0)
    head, x = torch.nn.Linear(32, 64), torch.randn(2, 3, 32)
    ranked = ranked_head(head, IDS)
    full, y = head(x), ranked(x)  # [2, 3, 64]
    assert y.shape == full.shape and ranked.out_features == 64 and ranked.in_features == 32
    torch.testing.assert_close(y[..., IDS], full[..., IDS])  # a BLAS may block 7 rows unlike 64: last bits
    assert bool(torch.isneginf(y[..., _outside(64, IDS)]).all())
    assert set(y.argmax(-1).flatten().tolist()) <= set(IDS.tolist())


def test_a_q4_heads_rows_of_s_are_its_own_blocks_across_segments(kernel_dir):
    """A head of two kinds (Q4_K rows then Q8_0 rows, S spanning both): S's logits equal the full head's bit for
    bit, in bfloat16 too, and the ranked head keeps the full head's route."""
    torch.manual_seed(1)
    w1, w2 = torch.randn(40, 256), torch.randn(24, 256)
    head = q4.Q4Linear(256, [("q4_k", quantize_q4_k(w1)), ("q8_0", quantize_q8_0(w2))], torch.randn(64), kernel_dir)
    head.dense_rows = 512
    ranked = ranked_head(head, IDS)
    assert ranked.sub.kinds == ("q4_k", "q8_0") and ranked.sub.dense_rows == 512
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(5, 256).to(dtype)
        y = ranked(x)
        assert y.dtype == dtype and torch.equal(y[:, IDS], head(x)[:, IDS])
        assert bool(torch.isneginf(y[:, _outside(64, IDS)]).all())


def test_sampling_from_a_ranked_head_puts_q_on_s_only():
    torch.manual_seed(2)
    logits = ranked_head(torch.nn.Linear(32, 64), IDS)(torch.randn(4, 32))  # [4, 64]
    sampler = Sampler(None, True, torch.tensor([], dtype=torch.long), torch.Generator().manual_seed(0))
    tokens, q, _ = sampler.draw([torch.tensor([1])] * 4, logits, False)
    assert set(tokens.tolist()) <= set(IDS.tolist())
    assert bool((q[:, _outside(64, IDS)] == 0).all()) and torch.allclose(q.sum(-1), torch.ones(4))


@pytest.mark.parametrize("mode", [{"speculation": "fixed", "num_speculative_tokens": 3}, {"speculation": "adaptive"}])
def test_speculative_greedy_with_a_ranked_draft_is_plain_greedy(models, mode):
    """The draft (a perturbed copy of the target) ranked to half the vocabulary: the target's output is its own
    plain greedy output, though the draft cannot propose the other half."""
    draft = rank_head(copy.deepcopy(models["noisy_copy"]), torch.arange(0, 64, 2))
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6]])
    plain = models["target"].generate(prompt, max_new_tokens=24, do_sample=False)
    costs = CostTable(verify_ms=tuple(10.0 + 4.0 * n for n in range(9)), draft_ms=2.0)
    out = models["target"].generate(
        prompt,
        assistant_model=draft,
        speculation_costs=costs,
        speculation_state=SpeculationState(),
        max_new_tokens=24,
        do_sample=False,
        rest=False,
        **mode,
    )
    assert torch.equal(out, plain)


def test_bad_ids_heads_and_sizes_are_refused_with_the_fix():
    head = torch.nn.Linear(32, 64)
    for ids, match in (([], "at least one"), ([1, 64], r"\[0, 64\)"), ([3, 3], "distinct")):
        with pytest.raises(ValueError, match=match):
            ranked_head(head, torch.tensor(ids, dtype=torch.long))
    with pytest.raises(TypeError, match="quantization='q4' or 'none'"):
        ranked_head(torch.nn.Embedding(64, 32), IDS)
    with pytest.raises(ValueError, match="RankedVocab"):
        RankedVocab(0)
    model = torch.nn.Module()
    model.head = head
    model.get_output_embeddings = lambda: model.head
    model.set_output_embeddings = lambda new: setattr(model, "head", new)
    assert isinstance(rank_head(model, IDS).head, RankedHead)
    with pytest.raises(ValueError, match="ranked already"):
        rank_head(model, IDS)


def test_rank_puts_the_forced_ids_first_then_the_most_frequent():
    counts = torch.tensor([0, 5, 9, 5, 0, 1])
    assert vocab_rank.rank(counts, first=[4, 2]).tolist() == [4, 2, 1, 3, 5]
    tok = build_tiny_tokenizer()
    counts, total = vocab_rank.count_tokens(tok, ["w3 w3 w7", "w7 w3"], 64)
    assert total == 5 and counts[3] == 3 and counts[7] == 2 and int(counts.sum()) == 5


def test_a_ranking_is_found_checked_and_cut_to_size(private_cache):
    tok = build_tiny_tokenizer()
    with pytest.raises(FileNotFoundError, match="ranked_vocab.py rank"):
        vocab_rank.ranking(tok)
    path = vocab_rank.cache_path(tok)
    vocab_rank.save_ranking(path, tok, torch.tensor([9, 2, 5]), "test text", 10)
    assert vocab_rank.ranking(tok).tolist() == [9, 2, 5] and vocab_rank.ranking(tok, 2).tolist() == [9, 2]
    with pytest.raises(ValueError, match="ranks 1 to 3 tokens"):
        vocab_rank.ranking(tok, 4)


def test_a_damaged_or_foreign_ranking_is_refused_naming_the_command(private_cache):
    tok = build_tiny_tokenizer()
    path = vocab_rank.cache_path(tok)
    vocab_rank.save_ranking(path, tok, torch.tensor([9, 2, 5]), "test text", 10)
    doc = json.loads(path.read_text())
    path.write_text(json.dumps({**doc, "counted_tokens": 11}))  # edited: the digest no longer matches
    with pytest.raises(ValueError, match="digest.*make it again: python benchmarks/ranked_vocab.py rank"):
        vocab_rank.ranking(tok)
    other = path.with_name("other.json")
    vocab_rank.save_ranking(other, tok, torch.tensor([1]), "test text", 1)
    foreign = {**json.loads(other.read_text()), "tokenizer": "0" * 16}
    foreign.pop("digest")
    from hf_adaspec.files import write_json_verified

    write_json_verified(path, foreign)
    with pytest.raises(ValueError, match="another tokenizer"):
        vocab_rank.ranking(tok)
