"""The playground's logic without a browser: frames, status line, update pacing, request handling, errors,
the page builds."""

from __future__ import annotations

import re
import threading

import gradio as gr
import pytest
from test_live import ByteTokenizer

import hf_adaspec
from hf_adaspec.engine.stats import SpeculationStats, StepRecord
from hf_adaspec.tools.live import LiveSnapshot, RunSettings
from hf_adaspec.tools.playground import LoadedPair, Playground, RunControl
from hf_adaspec.tools.playground_views import (
    DRAFTER_COLORS,
    SERIES_COLORS,
    UiCost,
    decisions_frame,
    k_frame,
    paced,
    stats_markdown,
    step_time_frame,
)

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = [StepRecord(4, 2, 3, "draft_model", 5.0, 25.0, 0.7, 90.0, predicted_ms=20.0),
         StepRecord(0, 0, 1, "plain", 0.0, 20.0, 0.6, 50.0)]  # predicted_ms NaN: not predicted


@pytest.fixture
def playground(tiny_factory, tmp_path, monkeypatch):
    """A playground whose "qwen" pair is a tiny Llama with a prompt-lookup-friendly fake tokenizer."""
    monkeypatch.setenv("HF_ADASPEC_CACHE", str(tmp_path))  # cost calibration writes here
    pg = Playground("qwen", max_prompt_tokens=40, preload=False)
    pg.pairs["qwen"] = LoadedPair(hf_adaspec.enable(tiny_factory(0)), ByteTokenizer(), tiny_factory(0), threading.Lock())
    return pg


def _run(pg: Playground, prompt: str = "abcabcabcabc", method: str = "adaptive", compare: bool = True, slo=None):
    return list(pg.run(RunControl(), prompt, "qwen", method, 3, 16, False, 0.7, 0.9, slo, compare))


def _skipped(value) -> bool:
    return isinstance(value, dict) and value == gr.skip()


def test_k_frame_has_every_step_and_the_whole_colour_domain():
    frame = k_frame(STEPS)
    assert frame["k"].tolist()[:2] == [4, 0] and frame["drafter"].tolist()[:2] == ["draft_model", "plain"]
    assert set(frame["drafter"]) == set(DRAFTER_COLORS)
    assert frame["k"].iloc[2:].isna().all()  # domain rows are not drawn
    assert set(k_frame([])["drafter"]) == set(DRAFTER_COLORS)


def test_step_time_frame_pairs_predicted_with_realized_ms_and_adds_plain_steps():
    frame = step_time_frame(STEPS, [12.0, 14.0, 13.0])
    series = {name: frame[frame.series == name]["ms"].tolist() for name in SERIES_COLORS}
    assert series["predicted"][0] == 20.0 and series["predicted"][1] != series["predicted"][1]  # NaN: not drawn
    assert series["realized"][:2] == [30.0, 20.0]  # draft_ms + verify_ms
    assert series["plain decoding"][:3] == [12.0, 14.0, 13.0]
    assert frame[frame.series == "plain decoding"]["step"].tolist()[:3] == [1.0, 2.0, 3.0]
    assert set(step_time_frame([])["series"]) == set(SERIES_COLORS)  # the whole colour domain from the start


def test_decisions_frame_keeps_the_latest_rows():
    frame = decisions_frame(STEPS * 10)
    assert len(frame) == 12 and frame["step"].tolist()[-1] == 20 and list(frame["k"])[-1] == 0
    assert frame["predicted ms"].tolist()[-2] == 20.0 and frame["realized ms"].tolist()[-2] == 30.0


def test_stats_markdown_reports_speedup_time_ratio_and_slo():
    snap = LiveSnapshot(stats=SpeculationStats(steps=STEPS, wall_ms=100.0, row_tokens=(5,)))
    text = stats_markdown(snap, RunSettings("adaptive", tpot_slo_ms=12.0), plain_tps=25.0)
    assert "50.0 tokens/s" in text and "speedup 2.00x" in text
    assert "step time realized/predicted 1.50 (median)" in text  # 30 ms against 20; the NaN step skipped
    assert "TPOT SLO 12 ms met by 75% of tokens" in text  # 3 tokens at 10 ms/token, 1 at 20
    assert "speedup" not in stats_markdown(snap, RunSettings("plain"), None)
    unpredicted = LiveSnapshot(stats=SpeculationStats(steps=STEPS[1:], wall_ms=100.0, row_tokens=(2,)))
    assert "realized/predicted n/a" in stats_markdown(unpredicted, RunSettings("adaptive"), None)


def _snapshots(n: int, done_at_end: bool = True):
    for i in range(n):
        yield LiveSnapshot(done=done_at_end and i == n - 1)


def test_paced_sends_charts_at_most_per_interval_and_always_at_the_end():
    ui = UiCost()
    views = list(paced(_snapshots(5), lambda snap, charts: charts, ui, chart_interval_s=3600.0))
    assert views == [True, False, False, False, True]  # the first update, then only the final one
    assert ui.updates == 5 and ui.build_s >= 0 and ui.serve_s >= 0
    assert list(paced(_snapshots(3), lambda snap, charts: charts, UiCost(), chart_interval_s=0.0)) == [True] * 3
    assert re.fullmatch(r"page: 5 updates, \d+\.\d ms server-side each", ui.line())


def test_paced_returns_the_last_snapshot_and_closes_its_source():
    source = _snapshots(4)
    gen = paced(source, lambda snap, charts: snap, UiCost(), 1.0)
    first = next(gen)
    gen.close()
    assert not first.done
    with pytest.raises(StopIteration):
        next(source)  # closed with the pacer: run_live's cleanup (stop, join) runs at once


def test_run_updates_text_every_time_and_charts_only_when_due(playground):
    playground.chart_interval_s, playground.text_interval_s = 3600.0, 0.0
    views = _run(playground, compare=False)
    assert len(views) >= 2
    for output, _, k_plot, time_plot, decisions, stats in views[1:-1]:
        assert output and not _skipped(output) and "adaptive" in stats
        assert _skipped(k_plot) and _skipped(time_plot) and _skipped(decisions)
    assert not any(_skipped(value) for value in views[-1])  # the final update carries everything
    assert re.search(r"page: \d+ updates", views[-1][-1])


def test_run_streams_views_then_the_plain_run_the_same_way_then_the_speedup(playground):
    views = _run(playground)
    pieces, plain_pieces, k_plot, time_plot, decisions, stats = views[-1]
    assert pieces and all(isinstance(text, str) for text, _ in pieces)
    assert "adaptive" in stats and "16 tokens" in stats and re.search(r"speedup \d+\.\d\dx", stats)
    assert re.search(r"page: \d+ updates, [\d.]+ ms server-side each", stats)
    steps = len(k_plot.dropna())  # how many steps the 15 tokens after the prefill's took depends on the
    assert 1 <= steps <= 15  # costs this machine calibrated (the draft is the target: it drafts or not)
    assert decisions["step"].tolist()[-1] == steps and len(decisions) == min(12, steps)
    plain_ms = time_plot[time_plot.series == "plain decoding"]["ms"].dropna()
    assert len(plain_ms) == 15 and (plain_ms >= 0).all()  # one per plain step after the prefill's token
    assert "".join(text for text, _ in plain_pieces) == "".join(text for text, _ in pieces)  # greedy: same text
    plain_phase = [v for v in views if "plain decoding of the same prompt, for the speedup" in v[-1]]
    assert plain_phase and all(_skipped(v[0]) and v[1] for v in plain_phase)  # the plain text streams
    assert any("running plain decoding" in v[-1] for v in views)
    assert len(playground.plain_runs) == 1  # a second run of the same prompt reuses it
    again = _run(playground)
    assert len(playground.plain_runs) == 1 and again[-1][1] == plain_pieces


def test_run_without_comparison_or_with_plain_method(playground):
    assert "speedup" not in _run(playground, compare=False)[-1][-1]
    plain = _run(playground, method="plain")[-1]
    assert "speedup" not in plain[-1] and len(plain[3][plain[3].series == "plain decoding"].dropna()) == 15
    assert not playground.plain_runs


def test_bad_intervals_are_refused():
    with pytest.raises(ValueError, match="intervals"):
        Playground("qwen", preload=False, chart_interval_s=-1.0)


@pytest.mark.parametrize(("prompt", "method", "message"), [
    ("   ", "adaptive", "prompt is empty"),
    ("a" * 41, "adaptive", "accepts at most 40"),
])
def test_bad_requests_become_page_errors(playground, prompt, method, message):
    with pytest.raises(gr.Error, match=message):
        _run(playground, prompt=prompt, method=method)


def test_model_errors_become_page_errors(playground, tiny_factory):
    playground.pairs["qwen"].draft = tiny_factory(1, vocab_size=80)
    with pytest.raises(gr.Error, match="vocabulary"):
        _run(playground)


def test_unknown_pair_and_bad_limit_are_refused():
    with pytest.raises(ValueError, match="unknown pair"):
        Playground("llama-70b", preload=False)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        Playground("qwen", max_prompt_tokens=0, preload=False)


def test_page_builds_with_its_components(playground):
    demo = playground.build()
    ids = {getattr(block, "elem_id", None) for block in demo.blocks.values()}
    assert {"prompt", "generate", "stop", "output", "plain-output", "stats", "k-plot", "time-plot", "decisions",
            "compare"} <= ids
    assert len(demo.fns) >= 2  # generate and stop


def test_run_control_survives_gradio_state_copies():
    import copy

    control = copy.deepcopy(RunControl())
    stop = control.start()
    control.stop.set()
    assert stop.is_set()
