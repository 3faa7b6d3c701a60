"""The slowdown bound (``policy.ledger``): its arithmetic, and the bound itself on a virtual clock that does not
depend on the machine. A replay of hand-made traces, priced by a hand-made profile: with a draft that never
agrees (but is confident: q = 0.9) and a steep verification curve, every request decodes within (1 + ε) of
plain plus one step; with a draft that always agrees, speculation still wins. The negative control breaks the
ledger (every action admitted: the goodput argmax and its optimistic calibration alone) and the same check
fails."""

from __future__ import annotations

import math

import pytest
from conftest import decide

from hf_adaspec import SpeculationConfig, SpeculationState
from hf_adaspec.costs.predictors import ProfileCell
from hf_adaspec.costs.profile import assemble_profile
from hf_adaspec.costs.table import CostTable
from hf_adaspec.policy.acceptance import ConfidenceAcceptance
from hf_adaspec.policy.confidence import ConfidenceCalibrator
from hf_adaspec.policy.controller import AdaptiveController, StepView
from hf_adaspec.policy.ledger import Ledger, admissible
from hf_adaspec.replay.clock import Clock
from hf_adaspec.replay.replay import ReplayRun, replay_request
from hf_adaspec.replay.trace import Trace

EPS = SpeculationConfig().max_slowdown
NEW, PROMPT = 96, 8
FAST = CostTable(verify_ms=(10.0,) * 12, draft_ms=1.0)  # 1 ms drafts, 10 ms verification at any width
STEP_MS, VERIFY_SLOPE_MS, DRAFT_MS, CATCHUP_MS = 10.0, 2.0, 2.0, 0.1


def _profile():
    """A steep verification (10 ms + 2 ms per extra token: a CPU's), a draft token at 2 ms and its catch-up at
    0.1 ms a column (one batched forward), at any batch size and context."""
    target = [
        ProfileCell(b, c, n, STEP_MS + VERIFY_SLOPE_MS * (n - 1)) for b in (1, 2) for c in (16, 256) for n in (1, 4, 9)
    ]
    draft = [
        ProfileCell(b, c, n, DRAFT_MS if n == 1 else 32 * CATCHUP_MS)
        for b in (1, 2)
        for c in (16, 256)
        for n in (1, 32)
    ]
    cells = {
        "target": target,
        "draft": draft,
        "held_out_target": [ProfileCell(1, 64, 2, STEP_MS + VERIFY_SLOPE_MS)],
        "held_out_draft": [ProfileCell(1, 64, 1, DRAFT_MS)],
    }
    return assemble_profile("hand", {"target": "hand-target"}, cells, {})


def _trace(qid: int, agree: bool) -> Trace:
    """A request whose tokens never repeat (prompt lookup and suffix drafting find nothing); the draft's argmax
    is the target's next token (``agree``) or another one, with q = 0.9 either way."""
    base = 1000 * qid
    prompt, generated = list(range(base, base + PROMPT)), list(range(base + PROMPT, base + PROMPT + NEW))
    nxt = [t if agree else t + 500 for t in generated] + [0]
    return Trace(
        qid,
        "hand",
        len(prompt),
        tuple(prompt + generated),
        tuple(nxt),
        (0.9,) * len(nxt),
        (1,),
        50.0,
        NEW,
        "hand-target",
        "hand-draft",
    )


def _runs(agree: bool, requests: int = 4) -> list[tuple[ReplayRun, ReplayRun]]:
    """(adaptive, plain) per request, the pair's learned state carried across requests as in a bench."""
    clock, state = Clock(_profile()), SpeculationState()
    traces = [_trace(qid, agree) for qid in range(1, requests + 1)]
    return [(replay_request([t], "adaptive", state, clock), replay_request([t], "plain", state, clock)) for t in traces]


def _within_bound(run: ReplayRun, plain: ReplayRun) -> bool:
    """adaptive's decoding time ≤ (1 + ε) × plain's + one plain step (both after the same prefill). The module's
    bound allows one step of any width; with a draft that never agrees its observed floor stays 0, so the ledger
    pays every admitted step in full from the slack and only the cost model's error (the profile's context
    buckets) remains, well inside one plain step."""
    prefill = plain.time_ms - STEP_MS * (NEW - 1)
    return run.time_ms - prefill <= (1.0 + EPS) * (plain.time_ms - prefill) + STEP_MS


def test_a_draft_that_never_agrees_costs_at_most_the_bound():
    for run, plain in _runs(agree=False):
        assert run.matches_trace
        assert _within_bound(run, plain), (run.time_ms, plain.time_ms, run.k_histogram)


def test_a_draft_that_always_agrees_still_wins():
    runs = _runs(agree=True)
    assert all(run.matches_trace for run, _ in runs)
    later = [plain.time_ms / run.time_ms for run, plain in runs[1:]]  # the pair has learned from one request
    assert min(later) > 1.5, later


def test_negative_control_a_ledger_that_admits_everything_breaks_the_bound(monkeypatch):
    """The same check fails once the ledger admits every action (exploration paid for in full)."""
    monkeypatch.setattr(Ledger, "admits", lambda self, cost_ms, floor_tokens: True)
    runs = _runs(agree=False)
    assert not all(_within_bound(run, plain) for run, plain in runs)


def test_the_slack_books_realized_time_against_the_plain_counterfactual():
    ledger = Ledger(0.1, t1_ms=10.0)
    assert ledger.slack_ms == 0.0 and ledger.plain_step_ms == 10.0
    ledger.book(10.0, 1, plain=True, predicted_ms=10.0)
    assert ledger.slack_ms == pytest.approx(1.0)  # (1 + ε) t_1 N − T = 11 − 10
    assert not ledger.admits(25.0, 2.0)  # 1 + 22 − 25 < 0: a step of 25 ms worth 2 tokens pessimistically
    assert ledger.admits(23.0, 2.0)
    ledger.book(40.0, 1, plain=False, predicted_ms=20.0)  # a rejected draft: one token for 40 ms
    assert ledger.slack_ms == pytest.approx(22.0 - 50.0)
    assert not ledger.admits(0.0, 10.0)  # overspent: nothing speculative until the slack is earned back
    assert ledger.scale == pytest.approx(1.5)  # median of the realized/predicted ratios 1 and 2


def test_admission_needs_a_non_negative_slack_and_a_non_negative_pessimistic_outcome():
    assert admissible(0.0, 10.0, 40.0, 4.0)  # 0 + 40 − 40 ≥ 0
    assert not admissible(0.0, 10.0, 41.0, 4.0)
    assert not admissible(-1.0, 10.0, 0.0, 5.0)  # not from a negative slack, however good the outcome
    assert admissible(math.inf, 10.0, 1e9, 1.0)  # no bound


def test_a_plain_steps_time_is_t1_and_predictions_are_put_on_the_realized_clock():
    ledger = Ledger(0.0, t1_ms=100.0)
    assert ledger.plain_step_ms == 100.0
    for ms in (4.0, 5.0, 6.0):
        ledger.book(ms, 1, plain=True, predicted_ms=100.0)
    assert ledger.plain_step_ms == 5.0 and ledger.scale == pytest.approx(0.05)
    assert ledger.admits(100.0, 1.0) and not ledger.admits(120.0, 1.0)  # 5 and 6 ms on the realized clock


@pytest.mark.parametrize("bad", [-0.1, math.nan, "0.02", True])
def test_a_bad_bound_is_refused_naming_the_keyword(bad):
    with pytest.raises(ValueError, match="max_slowdown"):
        SpeculationConfig(max_slowdown=bad)
    with pytest.raises(ValueError, match="max_slowdown"):
        Ledger(bad, 10.0)


def test_a_step_must_emit_a_token_in_finite_time():
    ledger = Ledger(0.02, 10.0)
    with pytest.raises(ValueError, match="emits >= 1 token"):
        ledger.book(10.0, 0, plain=True)
    with pytest.raises(ValueError, match="finite time"):
        ledger.book(math.inf, 1, plain=True)


def _controller(ledger: Ledger | None) -> AdaptiveController:
    return AdaptiveController(lambda b: FAST, [ConfidenceAcceptance(1, ConfidenceCalibrator())], [True], ledger=ledger)


def test_the_ledger_keeps_the_plan_and_each_drafted_column_inside_the_slack():
    """A new pair's draft (no observed prefix: its floor is 0) is priced by goodput as worth drafting; the
    ledger admits it only once plain steps have earned what it costs beyond a plain step's credit, and its stop
    rule then ends the proposal at the first column the slack cannot pay for."""
    view, unbounded = StepView(((12,),), (0,)), _controller(None)
    assert decide(unbounded, view).ks == (12,)  # goodput alone: draft
    ledger = Ledger(0.02, t1_ms=10.0)
    ctl = _controller(ledger)
    assert decide(ctl, view).ks == (0,)  # slack 0 < k + 10 ms − 10.2 ms at one token
    for _ in range(50):
        ledger.book(10.0, 1, plain=True)  # slack 10.2 · 50 − 500 = 10 ms
    decision = decide(ctl, view)
    assert decision.ks == (12,)  # admitted at k ≤ 10: 10 + 10.2 ≥ k + 10; the stop rule ends it
    stop = decision.stop(0)
    assert not stop(9, [(0.99,) * 9], [True])  # a tenth column: 10 + 10 ms ≤ 20.2
    assert stop(10, [(0.99,) * 10], [True])  # an eleventh: 11 + 10 ms > 20.2
    assert not decide(unbounded, view).stop(0)(10, [(0.99,) * 10], [True])  # without a ledger it drafts on


def test_the_window_median_is_statistics_median():
    """The ledger's sliding median (t_1 and the scale, once per booked step) equals ``statistics.median`` of the
    last 16 values, repeats and even counts included."""
    import random
    import statistics

    from hf_adaspec.policy.ledger import _Window

    window, seen, rng = _Window(16), [], random.Random(0)
    for i in range(300):
        value = 0.5 if i % 5 == 0 else rng.random()
        seen.append(value)
        assert window.add(value) == statistics.median(seen[-16:])
