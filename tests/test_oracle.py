"""Oracle bound: agreement runs and the oracle schedule's cost."""

import pytest

from hf_adaspec.oracle import agreement_runs, oracle_schedule


def flat(ms: float):
    return lambda n: ms


def test_agreement_runs():
    assert agreement_runs([True, True, False, True]) == [2, 1, 0, 1]
    assert agreement_runs([]) == []


def test_all_agree_drafts_k_max_runs():
    result = oracle_schedule([True] * 10, k_max=4, t_draft_ms=0.0, t_verify_ms=flat(50.0))
    assert result.ks == (4, 4)  # 5 tokens per step, 2 steps
    assert result.time_ms == pytest.approx(100.0)
    assert result.goodput == pytest.approx(100.0)  # 10 tokens in 0.1 s


def test_no_agreement_is_plain_decoding():
    result = oracle_schedule([False] * 6, k_max=4, t_draft_ms=5.0, t_verify_ms=flat(50.0))
    assert result.ks == (0,) * 6 and result.time_ms == pytest.approx(300.0)


def test_expensive_drafts_fall_back_to_plain_steps():
    result = oracle_schedule([True] * 4, k_max=3, t_draft_ms=100.0, t_verify_ms=flat(50.0))
    assert set(result.ks) == {0} and result.time_ms == pytest.approx(200.0)


def test_oracle_never_slower_than_plain():
    agree = [True, False, True, True, True, False, False, True]
    result = oracle_schedule(agree, k_max=8, t_draft_ms=10.0, t_verify_ms=lambda n: 40.0 + 5.0 * n)
    assert result.time_ms <= len(agree) * 45.0
    assert sum(k + 1 if k else 1 for k in result.ks) == len(agree)
