"""Bench bookkeeping: prompt selection, per-category speedups (geometric mean), markdown, errors."""

import json
from pathlib import Path

import pytest

from hf_adaspec.bench import Run, load_prompts, markdown, method_kwargs, summarize

SAMPLE = Path(__file__).parent / "data" / "spec_bench_sample.jsonl"


def test_load_prompts_first_turn_per_category():
    prompts = load_prompts(SAMPLE, per_category=1)
    assert [p.category for p in prompts] == ["coding", "math_reasoning", "qa", "summarization"]
    assert load_prompts(SAMPLE, 1, ["qa"])[0].text.strip()


def test_load_prompts_missing_file_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="--prompts"):
        load_prompts(tmp_path / "nope.jsonl", 1)


def _run(qid, cat, method, tps, match=True):
    return Run(qid, cat, method, 64, 64 / tps, tps, match)


def test_summarize_speedup_is_geometric_mean_of_ratios():
    runs = [
        _run(1, "a", "plain", 10.0), _run(1, "a", "adaptive", 20.0),
        _run(2, "a", "plain", 10.0), _run(2, "a", "adaptive", 5.0, match=False),
        _run(3, "b", "plain", 8.0), _run(3, "b", "adaptive", 12.0),
    ]
    summary = summarize(runs, ["plain", "adaptive"])
    assert summary["table"]["a"]["adaptive"]["speedup"] == pytest.approx(1.0)  # sqrt(2 * 0.5)
    assert summary["table"]["b"]["adaptive"]["speedup"] == pytest.approx(1.5)
    assert summary["table"]["overall"]["adaptive"]["speedup"] == pytest.approx(1.5 ** (1 / 3))
    assert summary["greedy_mismatches"] == {"plain": 0, "adaptive": 1}
    table = markdown(summary, ["plain", "adaptive"])
    assert "| b | 8.00 (1.00x) | 12.00 (1.50x) |" in table


def test_unknown_method_lists_valid_ones():
    with pytest.raises(ValueError, match="adaptive"):
        method_kwargs("turbo", None, 5)


def test_batch_bench_summary_speedups_unsupported_and_outputs(tmp_path):
    from hf_adaspec import batch_bench as bb

    runs = [
        bb.BatchRun(2, "plain", 2, 100, 10.0, 10.0, rows_equal_plain=2),
        bb.BatchRun(2, "plain", 2, 100, 10.0, 10.0, rows_equal_plain=2),
        bb.BatchRun(2, "hf-assisted", 2, 0, 0.0, 0.0, error="assisted generate is only supported for batch_size = 1"),
        bb.BatchRun(2, "adaptive", 2, 100, 8.0, 6.0, mean_k=1.0, acceptance=0.5, rows_equal_plain=2),
        bb.BatchRun(2, "adaptive", 2, 100, 12.0, 8.0, mean_k=3.0, acceptance=0.7, rows_equal_plain=1,
                    max_divergence_gap=0.125),
    ]
    methods = ["plain", "hf-assisted", "adaptive"]
    summary = bb.summarize(runs, methods)
    row = summary["table"][2]
    assert row["plain"]["tokens_per_s"] == 10.0 and row["adaptive"]["speedup"] == 1.0  # 200 tokens / 20 s each
    assert row["adaptive"]["mean_k"] == 2.0 and row["adaptive"]["mean_latency_s"] == 7.0
    assert row["adaptive"]["rows_equal_plain"] == 3 and row["adaptive"]["max_divergence_gap"] == 0.125
    assert "batch_size = 1" in row["hf-assisted"]["unsupported"]
    assert "unsupported" in bb.markdown(summary, methods)
    out = tmp_path / "b.json"
    bb.write_results(out, runs, summary, {"methods": methods})
    assert json.loads(out.read_text())["summary"]["table"]["2"]["adaptive"]["speedup"] == 1.0
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").stat().st_size > 0
