"""The playground's logic without a browser: frames, status line, request handling, errors, the page builds."""

from __future__ import annotations

import re
import threading

import gradio as gr
import pytest
from test_live import ByteTokenizer

import hf_adaspec
from hf_adaspec.engine.stats import SpeculationStats, StepRecord
from hf_adaspec.tools.live import LiveSnapshot, RunSettings
from hf_adaspec.tools.playground import (
    DRAFTER_COLORS,
    LoadedPair,
    Playground,
    RunControl,
    decisions_frame,
    goodput_frame,
    k_frame,
    stats_markdown,
)

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = [StepRecord(4, 2, 3, "draft_model", 5.0, 25.0, 0.7, 90.0), StepRecord(0, 0, 1, "plain", 0.0, 20.0, 0.6, 50.0)]


@pytest.fixture
def playground(tiny_factory, tmp_path, monkeypatch):
    """A playground whose "qwen" pair is a tiny Llama with a prompt-lookup-friendly fake tokenizer."""
    monkeypatch.setenv("HF_ADASPEC_CACHE", str(tmp_path))  # cost calibration writes here
    pg = Playground("qwen", max_prompt_tokens=40, preload=False)
    pg.pairs["qwen"] = LoadedPair(hf_adaspec.enable(tiny_factory(0)), ByteTokenizer(), tiny_factory(0), threading.Lock())
    return pg


def _run(pg: Playground, prompt: str = "abcabcabcabc", method: str = "adaptive", compare: bool = True, slo=None):
    return list(pg.run(RunControl(), prompt, "qwen", method, 3, 16, False, 0.7, 0.9, slo, compare))


def test_k_frame_has_every_step_and_the_whole_colour_domain():
    frame = k_frame(STEPS)
    assert frame["k"].tolist()[:2] == [4, 0] and frame["drafter"].tolist()[:2] == ["draft_model", "plain"]
    assert set(frame["drafter"]) == set(DRAFTER_COLORS)
    assert frame["k"].iloc[2:].isna().all()  # domain rows are not drawn
    assert set(k_frame([])["drafter"]) == set(DRAFTER_COLORS)


def test_goodput_frame_pairs_predicted_with_realized():
    frame = goodput_frame(STEPS).dropna()
    predicted = frame[frame.series == "predicted"]["tokens/s"].tolist()
    realized = frame[frame.series == "realized"]["tokens/s"].tolist()
    assert predicted == [90.0, 50.0] and realized == pytest.approx([100.0, 50.0])


def test_decisions_frame_keeps_the_latest_rows():
    frame = decisions_frame(STEPS * 10)
    assert len(frame) == 12 and frame["step"].tolist()[-1] == 20 and list(frame["k"])[-1] == 0


def test_stats_markdown_reports_speedup_and_slo():
    snap = LiveSnapshot(stats=SpeculationStats(steps=STEPS, wall_ms=100.0, row_tokens=(5,)))
    text = stats_markdown(snap, RunSettings("adaptive", tpot_slo_ms=12.0), plain_tps=25.0)
    assert "50.0 tokens/s" in text and "speedup 2.00x" in text
    assert "TPOT SLO 12 ms met by 75% of tokens" in text  # 3 tokens at 10 ms/token, 1 at 20
    assert "speedup" not in stats_markdown(snap, RunSettings("plain"), None)


def test_run_streams_views_then_the_speedup(playground):
    views = _run(playground)
    pieces, k_plot, goodput_plot, decisions, stats = views[-1]
    assert pieces and all(isinstance(text, str) for text, _ in pieces)
    assert "adaptive" in stats and "16 tokens" in stats and re.search(r"speedup \d+\.\d\dx", stats)
    steps = len(k_plot.dropna())  # how many steps the 15 tokens after the prefill's took depends on the
    assert 1 <= steps <= 15  # costs this machine calibrated (the draft is the target: it drafts or not)
    assert decisions["step"].tolist()[-1] == steps and len(decisions) == min(12, steps)
    assert any("running plain decoding" in v[-1] for v in views)
    assert len(playground.plain_rates) == 1  # a second run of the same prompt reuses it
    _run(playground)
    assert len(playground.plain_rates) == 1


def test_run_without_comparison_or_with_plain_method(playground):
    assert "speedup" not in _run(playground, compare=False)[-1][-1]
    assert "speedup" not in _run(playground, method="plain")[-1][-1]
    assert not playground.plain_rates


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
    assert {"prompt", "generate", "stop", "output", "stats", "k-plot", "goodput-plot", "decisions"} <= ids
    assert len(demo.fns) >= 2  # generate and stop


def test_run_control_survives_gradio_state_copies():
    import copy

    control = copy.deepcopy(RunControl())
    stop = control.start()
    control.stop.set()
    assert stop.is_set()
