"""llama-perplexity's scoring (hf_adaspec.bench.perplexity) on hand-computed toy cases."""

import math

import pytest
import torch

from hf_adaspec.bench.perplexity import chunk_nll, chunks, estimate

BIG = 50.0  # a row that must not be scored puts all its mass on the wrong token


def _toy():
    # n_ctx = 6: first = 3, scored positions j = 3, 4 (token j+1 under logits[j]); V = 2.
    tokens = torch.tensor([1, 1, 1, 1, 1, 0])
    logits = torch.full((6, 2), 0.0)
    logits[:, 0] = BIG  # rows 0-2 and 5: certain of token 0
    logits[3] = torch.tensor([0.0, 0.0])  # token[4] = 1: p = 1/2
    logits[4] = torch.tensor([math.log(3.0), 0.0])  # token[5] = 0: p = 3/4
    return logits, tokens


def test_chunk_nll_scores_second_half_next_token():
    logits, tokens = _toy()
    nll = chunk_nll(logits, tokens)
    assert nll.dtype == torch.float64
    assert nll.tolist() == pytest.approx([math.log(2.0), math.log(4 / 3)], rel=1e-6)


def test_chunk_nll_accepts_only_the_scored_positions():
    logits, tokens = _toy()
    assert chunk_nll(logits[3:], tokens).tolist() == pytest.approx(chunk_nll(logits, tokens).tolist(), rel=1e-9)
    with pytest.raises(ValueError, match="last 3"):
        chunk_nll(logits[4:], tokens)


def test_estimate_matches_llama_cpp_formula():
    est = estimate(torch.tensor([math.log(2.0), math.log(4 / 3)], dtype=torch.float64))
    assert est.tokens == 2
    assert est.ppl == pytest.approx(math.sqrt(8 / 3), rel=1e-12)
    assert est.err == pytest.approx(math.sqrt(8 / 3) * math.log(1.5) / 2, rel=1e-12)
    with pytest.raises(ValueError, match="at least 2"):
        estimate(torch.tensor([0.5]))


def test_chunks_drop_the_tail_and_place_bos():
    toks = list(range(10))
    assert chunks(toks, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert chunks(toks, 4, n_chunks=1) == [[0, 1, 2, 3]]
    assert chunks(toks, 4, bos=99) == [[99, 1, 2, 3], [99, 5, 6, 7]]
    with pytest.raises(ValueError, match="at least 12"):
        chunks(toks, 6)
