"""The request's token rows: a step's span written at once, stopped where token-by-token checking stops it; and
processors run once over a step's positions only where that equals running them position by position."""

from __future__ import annotations

import torch
from transformers import (
    EosTokenCriteria,
    LogitsProcessorList,
    MaxLengthCriteria,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_adaspec.backend import hf_compat
from hf_adaspec.engine.rows import TokenRows
from hf_adaspec.engine.settings import DecodeSettings
from hf_adaspec.engine.step_verify import processed_scores
from hf_adaspec.proposers.base import Proposal, Proposals


class StopAfter(StoppingCriteria):
    """A caller's criterion: stops a row whose last token is ``token``."""

    def __init__(self, token: int) -> None:
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def _rows(criteria, max_length: int = 50) -> TokenRows:
    prompt = torch.tensor([[0, 7, 8], [9, 10, 11]])  # row 0 has one column of left padding
    return TokenRows.open(prompt, torch.tensor([[0, 1, 1], [1, 1, 1]]), max_length, StoppingCriteriaList(criteria), 0)


def _token_by_token(criteria, row: list[int], new: list[int]) -> tuple[list[int], bool]:
    """What the loop did before: append one token at a time and ask every criterion after each."""
    for j, token in enumerate(new):
        row = [*row, token]
        if bool(StoppingCriteriaList(criteria)(torch.tensor([row]), None).all()):
            return new[: j + 1], True
    return new, False


def test_a_span_stops_where_token_by_token_checking_stops():
    cases = [
        ([EosTokenCriteria(5)], [1, 5, 2, 3]),  # EOS in the middle of an accepted span
        ([MaxLengthCriteria(6)], [1, 2, 3, 4]),  # the length cap inside the span
        ([EosTokenCriteria(5), StopAfter(2)], [1, 2, 5, 3]),  # a caller's criterion before the EOS
        ([EosTokenCriteria(5), StopAfter(3)], [1, 5, 3]),  # the EOS before a caller's criterion
        ([EosTokenCriteria(5), MaxLengthCriteria(50)], [1, 2, 3]),  # nothing stops it
    ]
    for criteria, new in cases:
        rows = _rows(criteria)
        stopped = rows.emit(0, new, now_ms=7.0)
        kept, expected_stop = _token_by_token(criteria, [0, 7, 8], new)
        assert rows.view(0).tolist() == [0, 7, 8, *kept], (criteria, new)
        assert stopped == expected_stop and (rows.finish_ms[0] == 7.0) == expected_stop
        assert rows.view(1).tolist() == [9, 10, 11]  # the other row is untouched


def test_split_reads_only_transformers_own_classes():
    class OwnEos(EosTokenCriteria):
        """A subclass may read more than the last token: it is asked per prefix."""

    split = hf_compat.split_stopping(
        StoppingCriteriaList([EosTokenCriteria([5, 6]), MaxLengthCriteria(9), MaxLengthCriteria(7), OwnEos(3)])
    )
    assert split.eos == {5, 6} and split.max_length == 7
    assert [type(c) for c in split.others] == [OwnEos]
    assert hf_compat.split_stopping(None) == hf_compat.StopSplit(frozenset(), None, None)


def test_processors_run_once_only_where_they_are_position_free():
    assert hf_compat.position_free(LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)]))
    assert hf_compat.position_free(None)
    assert not hf_compat.position_free(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3)]))


def test_scores_processed_at_once_equal_position_by_position():
    """``_scores`` over rows of k = 2 and 0: once over [Σ(k+1), V] for position-free processors equals the
    per-position path on each row's own prefix; a prefix-reading processor takes the per-position path."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 16, generator=gen)  # [b, K+1, V]
    proposals = Proposals.of([Proposal(torch.tensor([[3, 4]])), Proposal(torch.zeros(1, 0, dtype=torch.long))])
    rows = _rows([])
    free = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    settings = DecodeSettings(free, None, 50, True)
    at_once = processed_scores(logits, proposals, rows, settings, free=True)
    by_position = processed_scores(logits, proposals, rows, settings, free=False)
    assert torch.equal(at_once[0], by_position[0]) and torch.equal(at_once[1, :1], by_position[1, :1])
    penalty = DecodeSettings(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(2.0)]), None, 50, False)
    scores = processed_scores(logits, proposals, rows, penalty, free=False)
    assert scores[0, 2, 3] != logits[0, 2, 3] and scores[0, 0, 3] == logits[0, 0, 3]  # 3 is in the prefix only then


def test_a_draft_column_is_processed_at_once_where_the_processors_are_position_free():
    """``Sampler.draw`` runs position-free processors once over the column: its tokens and confidences equal
    processing each row on its own tokens; a prefix-reading processor still sees each row's own tokens."""
    from hf_adaspec.proposers.chain import Sampler

    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))  # [b, V]
    views = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6])]
    free = LogitsProcessorList([TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    sampler = Sampler(free, False, torch.zeros(0, dtype=torch.long))
    assert sampler.position_free
    tokens, _, conf = sampler.draw(views, logits, confident=True)
    rows = torch.cat([free(v[None], logits[i : i + 1]) for i, v in enumerate(views)])  # [b, V]
    assert torch.equal(tokens, rows.argmax(-1))
    assert torch.allclose(conf, torch.softmax(rows, -1).max(-1).values)
    penalty = Sampler(
        LogitsProcessorList([RepetitionPenaltyLogitsProcessor(50.0)]), False, torch.zeros(0, dtype=torch.long)
    )
    peaked = torch.full((3, 16), 0.5)
    peaked[:, 2] = 1.0  # token 2 leads everywhere, but row 0 holds it: the penalty moves row 0 off it only
    tokens, _, _ = penalty.draw(views, peaked, confident=False)
    assert tokens[0] != 2 and tokens[1] == tokens[2] == 2
