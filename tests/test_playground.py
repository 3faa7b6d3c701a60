"""The playground's logic without a browser: step rows, status line, the feed the page polls, request
handling, errors; slow: the Gradio side (a bad request as gr.Error, the page builds), which imports gradio."""

from __future__ import annotations

import re
import threading
import time

import pytest
from test_live import ByteTokenizer

import hf_adaspec
from hf_adaspec.engine.stats import SpeculationStats, StepRecord
from hf_adaspec.playground import page
from hf_adaspec.playground.live import LiveSnapshot, RunSettings
from hf_adaspec.playground.playground import LoadedPair, Playground, RunControl
from hf_adaspec.playground.views import (
    CURSOR_FIELDS,
    STEP_FIELDS,
    UiCost,
    stats_line,
    step_row,
)

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = [
    StepRecord(4, 2, 3, "draft_model", 5.0, 25.0, 0.7, 90.0, predicted_ms=20.0),
    StepRecord(0, 0, 1, "plain", 0.0, 20.0, 0.6, 50.0),
]  # predicted_ms NaN: not predicted


@pytest.fixture
def playground(tiny_factory, tmp_path, monkeypatch):
    """A playground whose "qwen" pair is a tiny Llama with a prompt-lookup-friendly fake tokenizer."""
    monkeypatch.setenv("HF_ADASPEC_CACHE", str(tmp_path))  # cost calibration writes here
    pg = Playground("qwen", max_prompt_tokens=40, preload=False)
    pg.pairs["qwen"] = LoadedPair(
        hf_adaspec.enable(tiny_factory(0)), ByteTokenizer(), tiny_factory(0), threading.Lock()
    )
    return pg


def _run(pg: Playground, prompt: str = "abcabcabcabc", method: str = "adaptive", compare: bool = True, slo=None):
    """Start a request and poll its feed as the page does (each answer's new items appended) until done:
    (everything the page got, the answers)."""
    run = pg.open_run(RunControl(), prompt, "qwen", method, 3, 16, False, 0.7, 0.9, slo, compare)
    got, answers = {name: [] for name in CURSOR_FIELDS}, []
    while not (answers and answers[-1]["done"]):
        answers.append(pg.poll({"run": run} | {name: len(items) for name, items in got.items()}))
        for name in CURSOR_FIELDS:
            got[name] += answers[-1][name]
        time.sleep(0.01)
    return got, answers


def test_step_row_has_the_fields_the_page_reads():
    rows = [step_row(s) for s in STEPS]
    assert [dict(zip(STEP_FIELDS, row)) for row in rows] == [
        {
            "drafter": "draft_model",
            "k": 4,
            "accepted": 2,
            "alpha": 0.7,
            "predicted_goodput": 90.0,
            "predicted_ms": 20.0,
            "realized_ms": 30.0,
        },
        {
            "drafter": "plain",
            "k": 0,
            "accepted": 0,
            "alpha": 0.6,
            "predicted_goodput": 50.0,
            "predicted_ms": None,
            "realized_ms": 20.0,
        },
    ]  # NaN: not predicted (JSON has no NaN)


def test_stats_line_reports_speedup_time_ratio_and_slo():
    snap = LiveSnapshot(stats=SpeculationStats(steps=STEPS, wall_ms=100.0, row_tokens=(5,)))
    text = stats_line(snap, RunSettings("adaptive", tpot_slo_ms=12.0), plain_tps=25.0)
    assert "50.0 tokens/s" in text and "speedup 2.00x" in text
    assert "step time realized/predicted 1.50 (median)" in text  # 30 ms against 20; the NaN step skipped
    assert "TPOT SLO 12 ms met by 75% of tokens" in text  # 3 tokens at 10 ms/token, 1 at 20
    assert "speedup" not in stats_line(snap, RunSettings("plain"), None)
    unpredicted = LiveSnapshot(stats=SpeculationStats(steps=STEPS[1:], wall_ms=100.0, row_tokens=(2,)))
    assert "realized/predicted n/a" in stats_line(unpredicted, RunSettings("adaptive"), None)
    assert UiCost(5, 0.01).line() == "page: 5 updates, 2.0 ms server-side each"


def test_feed_sends_only_what_is_new_then_the_plain_run_then_the_speedup(playground):
    got, answers = _run(playground)
    assert len(answers) >= 2 and answers[-1]["error"] is None
    stats = answers[-1]["stats"]
    assert "adaptive" in stats and "16 tokens" in stats and re.search(r"speedup \d+\.\d\dx", stats)
    assert re.search(r"page: \d+ updates, [\d.]+ ms server-side each", stats)
    steps = len(got["steps"])  # how many steps the 15 tokens after the prefill's took depends on the
    assert 1 <= steps <= 15  # costs this machine calibrated (the draft is the target: it drafts or not)
    assert sum(row[STEP_FIELDS.index("accepted")] + 1 for row in got["steps"]) == 15  # each step sent once
    assert len(got["plain_ms"]) == 15 and all(ms >= 0 for ms in got["plain_ms"])  # one per plain step
    text = "".join(t for t, _ in got["pieces"])
    assert text and "".join(t for t, _ in got["plain_pieces"]) == text  # greedy: the same text, each piece once
    assert all(not a["plain_pieces"] for a in answers if "generating…" in a["stats"])  # plain only after
    assert len(playground.plain_runs) == 1  # a second run of the same prompt reuses it
    again, _ = _run(playground)
    assert len(playground.plain_runs) == 1 and again["plain_pieces"] == got["plain_pieces"]


@pytest.mark.slow  # the fast suite keeps test_feed_sends_only_what_is_new_then_the_plain_run_then_the_speedup
def test_feed_without_comparison_or_with_plain_method(playground):
    got, answers = _run(playground, compare=False)
    assert "speedup" not in answers[-1]["stats"] and not got["plain_pieces"]
    got, answers = _run(playground, method="plain")
    assert "speedup" not in answers[-1]["stats"] and len(got["plain_ms"]) == 15 and not got["steps"]
    assert not playground.plain_runs


def test_stop_ends_the_run_and_a_new_request_stops_the_previous_one(playground):
    control = RunControl()
    first = playground.open_run(control, "abcabcabcabc", "qwen", "plain", 3, 16, False, 0.7, 0.9, None, True)
    feed = playground.feeds[first]
    second = playground.feeds[
        playground.open_run(control, "abcabcabcabc", "qwen", "plain", 3, 16, False, 0.7, 0.9, None, True)
    ]
    assert feed.main.stop.is_set() and not second.main.stop.is_set()  # the earlier run ends at its next token
    for run in (feed.main, second.main):
        run.close()  # waits until its generate returned
        assert run.finished.is_set()


def test_unknown_feed_answers_done_with_an_error(playground):
    answer = playground.poll({"run": "nope"})
    assert answer["done"] and answer["error"] == "unknown run" and "Generate again" in answer["stats"]


def test_bad_poll_interval_is_refused():
    with pytest.raises(ValueError, match="poll_interval_s"):
        Playground("qwen", preload=False, poll_interval_s=0.0)


@pytest.mark.parametrize(
    ("prompt", "method", "message"),
    [
        ("   ", "adaptive", "prompt is empty"),
        ("a" * 41, "adaptive", "accepts at most 40"),
    ],
)
def test_bad_requests_are_refused_naming_the_fix(playground, prompt, method, message):
    with pytest.raises(ValueError, match=message):
        _run(playground, prompt=prompt, method=method)


@pytest.mark.slow  # imports gradio; the fast suite keeps test_bad_requests_are_refused_naming_the_fix
def test_bad_requests_and_load_failures_become_page_errors(playground):
    import gradio as gr

    with pytest.raises(gr.Error, match="prompt is empty"):
        playground.start(RunControl(), "   ", "qwen", "adaptive", 3, 16, False, 0.7, 0.9, None, True)

    def failing_load(name):
        raise OSError("no such file")

    playground.pair = failing_load  # a pair that fails to load: named in the page
    with pytest.raises(gr.Error, match="OSError: no such file"):
        playground.start(RunControl(), "abc", "qwen", "adaptive", 3, 16, False, 0.7, 0.9, None, True)


@pytest.mark.slow  # the fast suite keeps test_unknown_feed_answers_done_with_an_error (an error in the feed)
def test_model_errors_come_back_in_the_feed(playground, tiny_factory):
    playground.pairs["qwen"].draft = tiny_factory(1, vocab_size=80)
    _, answers = _run(playground)
    assert "vocabulary" in answers[-1]["error"] and "error: " in answers[-1]["stats"]
    got, _ = _run(playground, method="plain")  # the server keeps serving
    assert got["pieces"]


def test_unknown_pair_and_bad_limit_are_refused():
    with pytest.raises(ValueError, match="unknown pair"):
        Playground("llama-70b", preload=False)
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        Playground("qwen", max_prompt_tokens=0, preload=False)


@pytest.mark.slow  # imports gradio (the browser test drives the page)
def test_page_builds_with_its_components(playground):
    demo = playground.build()
    ids = {getattr(block, "elem_id", None) for block in demo.blocks.values()}
    assert {"prompt", "generate", "stop", "compare", "live"} <= ids
    for inner in ("output", "plain-output", "stats", "k-plot", "time-plot", "decisions"):  # the live view's
        assert f'id="{inner}"' in page.TEMPLATE
    live = next(block for block in demo.blocks.values() if getattr(block, "elem_id", None) == "live")
    assert [fn.__name__ for fn in live.server_fns] == ["poll"]
    assert len(demo.fns) >= 2  # generate and stop


def test_run_control_survives_gradio_state_copies():
    import copy

    control = copy.deepcopy(RunControl())
    stop = control.start()
    control.stop.set()
    assert stop.is_set()
