"""StepRecord bookkeeping: how each emitted token was made, realized goodput."""

from __future__ import annotations

import math

import pytest

from hf_adaspec import StepRecord


def _record(k: int, accepted: int, emitted: int, drafter: str = "draft_model") -> StepRecord:
    return StepRecord(k, accepted, emitted, drafter if k else "plain", 2.0, 8.0, 0.5, 100.0)


@pytest.mark.parametrize(
    ("k", "accepted", "emitted", "expected"),
    [
        (0, 0, 1, ("plain",)),
        (3, 3, 4, ("draft_model",) * 3 + ("bonus",)),
        (3, 1, 2, ("draft_model", "correction")),
        (4, 0, 1, ("correction",)),
        (3, 3, 2, ("draft_model",) * 2),  # a stopping criterion cut the step short
    ],
)
def test_token_sources(k, accepted, emitted, expected):
    assert _record(k, accepted, emitted).token_sources() == expected


def test_token_sources_names_the_drafter():
    assert _record(2, 2, 3, "prompt_lookup").token_sources() == ("prompt_lookup", "prompt_lookup", "bonus")


def test_realized_goodput_is_tokens_per_second_of_step_time():
    assert _record(3, 2, 3).realized_goodput == pytest.approx(300.0)  # 3 tokens in 10 ms
    assert math.isnan(StepRecord(0, 0, 1, "plain", 0.0, 0.0, 0.5, 1.0).realized_goodput)
