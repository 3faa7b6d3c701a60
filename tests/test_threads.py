"""The engine's thread count follows the machine (``engine.threads``): which count the chooser runs, when
it tries the other, and that generate hands torch's count back."""

from __future__ import annotations

import math

import pytest
import torch

import hf_adaspec
from hf_adaspec import SpeculationState
from hf_adaspec.costs.table import CostTable
from hf_adaspec.engine.threads import (
    EXPLORE_EVERY,
    EXPLORE_FIRST,
    EXPLORE_STEPS,
    ThreadChooser,
)


def _run(chooser: ThreadChooser, steps: int, ms: dict[int, float]) -> list[int]:
    """``steps`` picks, each observed at ``ms[count]`` realized against 100 ms predicted."""
    picks = []
    for _ in range(steps):
        count = chooser.pick()
        chooser.observe(count, ms[count], 100.0)
        picks.append(count)
    return picks


def test_the_default_runs_until_the_other_count_is_tried_and_stays_when_faster():
    chooser = ThreadChooser((2, 1))
    picks = _run(chooser, EXPLORE_FIRST + EXPLORE_STEPS + EXPLORE_EVERY + EXPLORE_STEPS, {2: 60.0, 1: 90.0})
    assert picks[:EXPLORE_FIRST] == [2] * EXPLORE_FIRST
    assert picks[EXPLORE_FIRST : EXPLORE_FIRST + EXPLORE_STEPS] == [1] * EXPLORE_STEPS  # the first try
    assert picks[EXPLORE_FIRST + EXPLORE_STEPS : -EXPLORE_STEPS] == [2] * EXPLORE_EVERY
    assert picks[-EXPLORE_STEPS:] == [1] * EXPLORE_STEPS  # tried again after EXPLORE_EVERY steps
    assert chooser.best == 2


def test_one_thread_takes_over_when_the_machine_is_loaded_and_hands_back_when_it_is_not():
    chooser = ThreadChooser((2, 1))
    _run(chooser, 40, {2: 250.0, 1: 90.0})  # a core is busy: two threads wait on it
    assert chooser.best == 1
    picks = _run(chooser, 2 * EXPLORE_EVERY, {2: 60.0, 1: 90.0})  # the load is gone
    assert chooser.best == 2 and picks[-10:] == [2] * 10


def test_a_try_waits_while_the_request_cannot_pay_for_it():
    """``pick(explore=False)`` (the slowdown ledger's slack short of a step): the due try neither starts nor
    goes on; it starts once exploring is allowed again."""
    chooser = ThreadChooser((2, 1))
    assert [chooser.pick(explore=False) for _ in range(3 * EXPLORE_FIRST)] == [2] * (3 * EXPLORE_FIRST)
    assert chooser.pick() == 1  # due since EXPLORE_FIRST steps: the try starts now
    assert chooser.pick(explore=False) == 2  # and stops as soon as the slack is short again


def test_one_candidate_never_explores_and_bad_times_are_ignored():
    chooser = ThreadChooser.for_threads(1)
    assert chooser.counts == (1,) and set(_run(chooser, 300, {1: 50.0})) == {1}
    chooser = ThreadChooser((4, 1))
    chooser.observe(4, float("nan"), 100.0)
    chooser.observe(4, 50.0, 0.0)
    chooser.observe(3, 50.0, 100.0)  # not a candidate
    assert chooser.seen == {}


@pytest.mark.parametrize("counts", [(), (0,), (2, 1.5), (True,)])
def test_thread_counts_must_be_positive_integers(counts):
    with pytest.raises(ValueError, match="thread counts must be integers >= 1"):
        ThreadChooser(counts)


def test_generate_picks_threads_per_step_and_hands_torchs_count_back(models, one_thread):
    """With a chooser between 2 threads and 1 the run tries both; torch's count is restored afterwards, and
    ``adapt_threads=False`` leaves it untouched. Started on one thread (one_thread): the run's 2-thread steps
    are then the chooser's doing, and handing back means returning to 1."""
    table = CostTable(verify_ms=tuple(10.0 + n for n in range(9)), draft_ms=3.0)
    before = torch.get_num_threads()
    target = hf_adaspec.enable(models["target"])
    state = SpeculationState(threads=ThreadChooser((2, 1)))
    prompt = torch.tensor([[5, 9, 13, 2, 7, 5, 9, 13]])
    out = target.generate(
        prompt,
        speculation="adaptive",
        speculation_costs=table,
        max_new_tokens=40,
        do_sample=False,
        speculation_state=state,
        return_dict_in_generate=True,
        max_slowdown=math.inf,
    )  # a try from the 9th step (with the bound it waits for slack)
    assert torch.get_num_threads() == before
    assert set(state.threads.seen) == {2, 1} and sum(state.threads.seen.values()) == len(out.speculation.steps)
    fixed = SpeculationState(threads=ThreadChooser((2, 1)))
    target.generate(
        prompt,
        speculation="adaptive",
        speculation_costs=table,
        max_new_tokens=40,
        do_sample=False,
        speculation_state=fixed,
        adapt_threads=False,
    )
    assert fixed.threads.seen == {} and torch.get_num_threads() == before
