"""Live runs as the playground paces them: arrival times, the update bound, the realized/predicted ratio."""

from __future__ import annotations

import math
import threading

import pytest
from conftest import single_thread, slow_except
from test_live import COSTS, PROMPT, ByteTokenizer

import hf_adaspec
from hf_adaspec.engine.stats import StepRecord
from hf_adaspec.playground.live import LiveSnapshot, MainThreadRunner, RunSettings, median_time_ratio, run_live

pytestmark = pytest.mark.usefixtures("one_thread")


def _step(draft_ms: float, verify_ms: float, predicted_ms: float) -> StepRecord:
    return StepRecord(2, 1, 2, "draft_model", draft_ms, verify_ms, 0.5, 10.0, predicted_ms=predicted_ms)


def test_median_time_ratio_skips_unpredicted_steps():
    steps = [_step(10.0, 30.0, 20.0), _step(0.0, 30.0, 10.0), _step(5.0, 5.0, 10.0), _step(1.0, 1.0, math.nan)]
    assert median_time_ratio(steps) == 2.0  # ratios 2, 3, 1; the NaN step skipped
    assert median_time_ratio(steps[:2]) == 2.5  # an even count: the mean of the middle two
    assert math.isnan(median_time_ratio(steps[3:])) and math.isnan(median_time_ratio([]))
    assert math.isnan(median_time_ratio([_step(1.0, 1.0, 0.0)]))  # a zero prediction is no prediction


def test_step_intervals_are_the_gaps_between_arrivals():
    assert LiveSnapshot(arrivals_ms=[100.0, 130.0, 170.0]).step_intervals_ms() == [30.0, 40.0]
    assert LiveSnapshot().step_intervals_ms() == [] and LiveSnapshot(arrivals_ms=[5.0]).step_intervals_ms() == []


@pytest.fixture(scope="module")
def target(tiny_factory):
    with single_thread():  # the model's own thread chooser follows torch's count at enable; one_thread comes later
        return hf_adaspec.enable(tiny_factory(0))


# the fast suite keeps prompt lookup's case (steps of several tokens); plain's is slow
@pytest.mark.parametrize("method", slow_except(["plain", "prompt-lookup"], fast={"prompt-lookup"}))
def test_a_long_interval_still_ends_with_the_final_update_at_once(target, method):
    extra = COSTS if method != "plain" else None
    snaps = [
        (s.done, s.stats.new_tokens, len(s.arrivals_ms))
        for s in run_live(
            target,
            ByteTokenizer(),
            PROMPT,
            RunSettings(method, max_new_tokens=20),
            extra_kwargs=extra,
            min_interval_s=3600.0,
        )
    ]  # the join wakes when generate returns: no hour-long wait
    assert len(snaps) <= 2 and snaps[-1][:2] == (True, 20)  # the first arrival, then the final update
    last = list(run_live(target, ByteTokenizer(), PROMPT, RunSettings(method, max_new_tokens=20), extra_kwargs=extra))[
        -1
    ]
    arrivals = last.arrivals_ms
    assert arrivals == sorted(arrivals) and arrivals[0] == pytest.approx(last.stats.prefill_ms)
    assert arrivals[-1] == pytest.approx(last.stats.wall_ms)
    assert len(arrivals) == (20 if method == "plain" else len(last.stats.steps) + 1)  # the prefill's token first


def test_main_thread_runner_runs_calls_on_the_serving_thread(target):
    """run_live through a MainThreadRunner: generate runs on the thread that serves the runner, and the
    observer (here another thread) still gets every step."""
    runner, stop, seen = MainThreadRunner(), threading.Event(), {}

    def submit(call):
        def on_server():
            seen["thread"] = threading.current_thread()
            call()

        runner.submit(on_server)

    def observe():
        try:
            seen["snapshots"] = list(
                run_live(target, ByteTokenizer(), PROMPT, RunSettings("plain", max_new_tokens=6), launch=submit)
            )
        finally:
            stop.set()

    observer = threading.Thread(target=observe)
    observer.start()
    runner.serve(stop, poll_s=0.05)
    observer.join()
    assert seen["thread"] is threading.current_thread()
    assert seen["snapshots"][-1].done and seen["snapshots"][-1].stats.new_tokens == 6
