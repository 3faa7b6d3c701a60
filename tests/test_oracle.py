"""Oracle bound: agreement runs and the fastest schedule's cost (dynamic programming over drafters)."""

import itertools

import pytest

from hf_adaspec.bench.oracle import OracleDrafter, agreement_runs, oracle_schedule


def flat(ms: float):
    return lambda n: ms


def drafter(agree, draft_ms=0.0, setup_ms=0.0):
    return OracleDrafter(tuple(agreement_runs(agree)), draft_ms, setup_ms)


def test_agreement_runs():
    assert agreement_runs([True, True, False, True]) == [2, 1, 0, 1]
    assert agreement_runs([]) == []


def test_all_agree_drafts_k_max_runs():
    result = oracle_schedule([drafter([True] * 10)], k_max=4, t_verify_ms=flat(50.0))
    assert result.ks == (4, 4)  # 5 tokens per step, 2 steps
    assert result.drafters == (0, 0)
    assert result.time_ms == pytest.approx(100.0)
    assert result.goodput == pytest.approx(100.0)  # 10 tokens in 0.1 s


def test_no_agreement_is_plain_decoding():
    result = oracle_schedule([drafter([False] * 6, draft_ms=5.0)], k_max=4, t_verify_ms=flat(50.0))
    assert result.ks == (0,) * 6 and result.drafters == (-1,) * 6 and result.time_ms == pytest.approx(300.0)


def test_expensive_drafts_fall_back_to_plain_steps():
    result = oracle_schedule([drafter([True] * 4, draft_ms=100.0)], k_max=3, t_verify_ms=flat(50.0))
    assert set(result.ks) == {0} and result.time_ms == pytest.approx(200.0)


def test_setup_paid_only_when_the_drafter_is_used():
    agree = [True] * 3 + [False] * 5
    cheap = oracle_schedule([drafter(agree, setup_ms=10.0)], k_max=8, t_verify_ms=flat(50.0))
    assert cheap.time_ms == pytest.approx(10.0 + 50.0 * 5)  # k=3 emits 4 tokens, then 4 plain steps
    costly = oracle_schedule([drafter(agree, setup_ms=500.0)], k_max=8, t_verify_ms=flat(50.0))
    assert costly.time_ms == pytest.approx(400.0) and set(costly.drafters) == {-1}


def test_two_drafters_take_the_better_one_per_step():
    lookup = drafter([True, True, False, False, False, False], draft_ms=0.0)
    model = drafter([False, False, True, True, True, False], draft_ms=5.0)
    result = oracle_schedule([model, lookup], k_max=8, t_verify_ms=flat(50.0))
    assert result.drafters == (1, 0) and result.ks == (2, 2)
    assert result.time_ms == pytest.approx(50.0 + 60.0)


def test_oracle_is_the_minimum_over_every_schedule():
    agree = [True, False, True, True, True, False, False, True]
    t_verify = lambda n: 40.0 + 5.0 * n  # noqa: E731
    result = oracle_schedule([drafter(agree, draft_ms=10.0)], k_max=8, t_verify_ms=t_verify)
    runs = agreement_runs(agree)

    def brute(i):  # every legal schedule from position i
        if i == len(agree):
            return 0.0
        options = [t_verify(1) + brute(i + 1)]
        options += [
            k * 10.0 + t_verify(k + 1) + brute(i + k + 1) for k in range(1, min(runs[i], len(agree) - i - 1) + 1)
        ]
        return min(options)

    assert result.time_ms == pytest.approx(brute(0))
    assert sum(k + 1 for k in result.ks) == len(agree)
    assert result.time_ms <= len(agree) * t_verify(1)


def test_runs_of_different_lengths_are_an_error():
    with pytest.raises(ValueError, match="same generated tokens"):
        oracle_schedule([drafter([True]), drafter([True, False])], k_max=2, t_verify_ms=flat(1.0))


def test_every_step_drafts_no_more_than_accepted():
    agree = [a == "1" for a in "1101110011"]
    result = oracle_schedule([drafter(agree, draft_ms=1.0)], k_max=3, t_verify_ms=flat(30.0))
    runs, i = agreement_runs(agree), 0
    for k in result.ks:
        assert k <= min(runs[i], 3)
        i += k + 1
    assert list(itertools.accumulate(k + 1 for k in result.ks))[-1] == len(agree)
