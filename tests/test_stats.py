"""Stats: StepRecord bookkeeping (how each emitted token was made, realized goodput) and SpeculationStats,
one type for every batch size (``row(i)``, the batch and the batch-of-one summaries)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_adaspec import (
    CostTable,
    SpeculationState,
    SpeculationStats,
    SpeculativeGenerateOutput,
    StepRecord,
)


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


# --- SpeculationStats: one type for every batch size, read through generate ------------------------------

COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # passing costs skips calibration
PROMPTS = ([5, 6, 7, 8, 9, 10] * 4, [11, 12, 13], [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 8])  # no pad id 0


def _generate(models, prompts, **kwargs) -> SpeculativeGenerateOutput:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return models["target"].generate(
        ids,
        attention_mask=mask,
        assistant_model=models["noisy_copy"],
        speculation="fixed",
        num_speculative_tokens=3,
        speculation_costs=COSTS,
        speculation_state=SpeculationState(),
        do_sample=False,
        return_dict_in_generate=True,
        **kwargs,
    )


def test_batch_stats_rows_partition_the_records_and_match_the_output(models, one_thread):
    eos = models["target"].generate(torch.tensor([PROMPTS[1]]), max_new_tokens=6, do_sample=False)[0, -1].item()
    out = _generate(models, PROMPTS, max_new_tokens=12, eos_token_id=eos, pad_token_id=0)
    stats, width = out.speculation, max(len(p) for p in PROMPTS)
    assert isinstance(stats, SpeculationStats) and stats.batch == 3
    lengths = tuple(int((row != 0).sum()) for row in out.sequences[:, width:])  # generated tokens per row
    assert stats.row_tokens == lengths and stats.new_tokens == sum(lengths)
    assert stats.row_tokens[1] <= 6 < 12 and max(stats.row_tokens) == 12  # rows finished at different times

    views = [stats.row(i) for i in range(3)]
    assert sorted((s.step, s.row) for v in views for s in v.steps) == sorted((s.step, s.row) for s in stats.steps)
    for i, view in enumerate(views):
        assert isinstance(view, SpeculationStats) and view.batch == 1
        assert {s.row for s in view.steps} == {i} and view.row_tokens == (stats.row_tokens[i],)
        assert sum(s.emitted for s in view.steps) == view.new_tokens - 1  # the prefill emits the first token
        assert view.wall_ms == stats.finish_ms[i] > 0
        assert "rows" not in view.summary()
    with pytest.raises(IndexError, match="row 3"):
        stats.row(3)
    with pytest.raises(IndexError):
        stats.row(-1)

    summary = stats.summary()
    assert summary.startswith(f"3 rows, {stats.new_tokens} tokens")
    hist = " ".join(f"{k}:{n}" for k, n in stats.k_histogram.items())
    assert f"k histogram {{{hist}}}" in summary and "draft reused" not in summary and "SLO" not in summary
    data = json.loads(json.dumps(stats.to_dict()))
    assert data["row_tokens"] == list(stats.row_tokens) and data["new_tokens"] == stats.new_tokens
    assert len(data["steps"]) == len(stats.steps) and data["steps"][0].keys() >= {"row", "step", "k", "drafter"}


def test_batch_of_one_summary_is_the_requests(models, one_thread):
    stats = _generate(models, PROMPTS[:1], max_new_tokens=16).speculation
    assert stats.batch == 1 and stats.row_tokens == (16,) and stats.new_tokens == 16
    assert stats.row(0).steps == stats.steps and {s.row for s in stats.steps} == {0}
    assert [s.step for s in stats.steps] == list(range(len(stats.steps)))
    assert stats.mean_accepted_length == pytest.approx(15 / len(stats.steps))
    assert stats.acceptance_rate == pytest.approx(sum(s.accepted for s in stats.steps) / sum(s.k for s in stats.steps))
    assert stats.mean_k == pytest.approx(sum(s.k for s in stats.steps) / len(stats.steps))
    assert stats.plain_share == sum(s.k == 0 for s in stats.steps) / len(stats.steps)
    assert sum(stats.k_histogram.values()) == len(stats.steps) and max(stats.k_histogram) <= 3
    summary = stats.summary()
    assert summary.startswith("16 tokens in ") and "rows" not in summary
    assert f"mean accepted length {stats.mean_accepted_length:.2f}" in summary


def test_summary_numbers_from_hand_built_records():
    steps = [_record(0, 0, 1), _record(4, 2, 3), StepRecord(2, 2, 3, "prompt_lookup", 0.0, 5.0, 0.4, 1.0, row=1)]
    stats = SpeculationStats(steps=steps, wall_ms=100.0, prefill_ms=20.0, row_tokens=(5, 4), finish_ms=(100.0, 60.0))
    assert stats.new_tokens == 9 and stats.batch == 2
    assert stats.tokens_per_s == pytest.approx(90.0) and stats.decode_tokens_per_s == pytest.approx(1000 * 7 / 80)
    assert stats.mean_accepted_length == pytest.approx(7 / 3) and stats.acceptance_rate == pytest.approx(4 / 6)
    assert stats.k_histogram == {0: 1, 2: 1, 4: 1} and stats.plain_share == pytest.approx(1 / 3)
    assert stats.mean_latency_ms == pytest.approx(80.0)
    assert stats.row(1).steps == steps[2:] and stats.row(1).wall_ms == 60.0
    assert math.isnan(SpeculationStats(steps=[_record(0, 0, 1)], row_tokens=(2,)).acceptance_rate)


def test_every_step_records_its_predicted_time(models, one_thread):
    """With a cost table, each step's ``predicted_ms`` is the table's price of the step as it ran."""
    table = CostTable(verify_ms=tuple(10.0 + n for n in range(9)), draft_ms=3.0)
    out = models["target"].generate(
        torch.tensor([[5, 9, 13, 2, 7, 5, 9, 13]]),
        assistant_model=models["noisy_copy"],
        speculation="adaptive",
        speculation_costs=table,
        max_new_tokens=24,
        do_sample=False,
        return_dict_in_generate=True,
        speculation_state=SpeculationState(),
    )
    steps = out.speculation.steps
    assert steps and all(s.predicted_ms >= table.t_verify(s.k + 1) for s in steps)
    assert all(s.predicted_ms == table.t_verify(1) for s in steps if s.k == 0)
