"""Confidence-prior drafting and token elimination for batches: the width math, the controller, the draft
loop's stop rule, and that elimination runs for greedy decoding only."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from hf_adaspec import CostTable
from hf_adaspec.batch_confidence import BatchConfidenceController
from hf_adaspec.batch_controller import BatchDecision, BatchGoodputController
from hf_adaspec.batch_engine import _propose
from hf_adaspec.confidence import ConfidenceCalibrator
from hf_adaspec.elimination import batch_expected_tokens, best_width, should_draft_column, width_goodput
from hf_adaspec.proposers.base import Proposal
from hf_adaspec.proposers.batch_base import BatchRows
from hf_adaspec.proposers.batch_draft_model import BatchDraftModelProposer

pytestmark = pytest.mark.usefixtures("one_thread")


def linear(n: int) -> float:
    """Verify cost 10 + 5·n ms for n new tokens per row."""
    return 10.0 + 5.0 * n


def flat(n: int) -> float:
    return 10.0


# --- width math -------------------------------------------------------------------------------------

def test_best_width_by_hand():
    probs = [[0.9, 0.5, 0.1], [0.8]]
    # w=0: 2/18 ms; w=1: 3.7/23; w=2: 4.2/28; w=3: 4.3/33 (3 ms already spent drafting)
    rates = [width_goodput(probs, w, 3.0, linear) for w in range(4)]
    assert rates == pytest.approx([1000 * 2 / 18, 1000 * 3.7 / 23, 1000 * 4.2 / 28, 1000 * 4.3 / 33])
    assert best_width(probs, 3.0, linear) == 1
    assert batch_expected_tokens(probs, 2) == pytest.approx(4.2)


def test_best_width_keeps_everything_when_verifying_is_free_and_cuts_worthless_tails():
    assert best_width([[0.9, 0.5, 0.1], [0.8]], 3.0, flat) == 3
    assert best_width([[0.9, 0.0, 0.0]], 3.0, flat) == 1  # ties keep the narrower width
    assert best_width([[0.01, 0.0]], 0.0, linear) == 0  # nothing worth a verified position: a plain step
    assert best_width([[], []], 0.0, linear) == 0
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        best_width([[1.2]], 0.0, linear)


def test_should_draft_column_is_the_marginal_goodput_test():
    # one row at P_1 = 0.9 after 1 ms: now 1.9 / 11 ms; one more column at 1 ms: (1.9 + p) / 12 ms
    threshold = 1.9 * 12 / 11 - 1.9
    assert should_draft_column([[0.9]], [threshold + 1e-6], 1.0, 1.0, flat)
    assert not should_draft_column([[0.9]], [threshold - 1e-6], 1.0, 1.0, flat)
    # a second row that cannot grow adds its tokens to "now" but nothing to the next column
    assert not should_draft_column([[0.9], [0.9]], [threshold + 1e-6, 0.0], 1.0, 1.0, flat)


# --- controller -------------------------------------------------------------------------------------

COSTS = CostTable(verify_ms=tuple(linear(n) for n in range(1, 10)), draft_ms=1.0)


def _controller(rows: int = 2, optimism: float = 0.0) -> BatchConfidenceController:
    plan = BatchGoodputController(lambda b: COSTS, rows, [True])
    return BatchConfidenceController(plan, ConfidenceCalibrator(optimism=optimism), lambda b: COSTS)


def _proposal(k: int, confidences: tuple[float, ...]) -> Proposal:
    return Proposal(torch.arange(k)[None], None, confidences)


def test_choose_offers_drafting_rows_their_upper_bound():
    ctl = _controller()
    decision = ctl.choose([[6, 4]], [0], horizon=64)
    assert decision.ks == (6, 4) and decision.drafters == (0, 0)
    costly = BatchConfidenceController(BatchGoodputController(lambda b: CostTable((10.0,) * 9, 50.0), 2, [True]),
                                       ConfidenceCalibrator(), lambda b: CostTable((10.0,) * 9, 50.0))
    assert costly.choose([[6, 4]], [0], horizon=64).ks == (0, 0)  # a 50 ms draft token never pays


def test_eliminate_cuts_every_row_to_the_best_width():
    ctl = _controller()  # identity calibration: P_j = c_j
    proposals = [_proposal(3, (0.9, 0.9, 0.2)), _proposal(1, (0.8,))]
    # c = (0.9, 0.81, 0.162) and (0.8,): same shape as test_best_width_by_hand, width 2 wins here
    probs = [[ctl.calibrator.predict(c) for c in (0.9, 0.81, 0.162)], [ctl.calibrator.predict(0.8)]]
    width = best_width(probs, 3.0, linear)
    cut = ctl.eliminate(proposals, (0, 0), spent_ms=3.0)
    assert [p.k for p in cut] == [min(3, width), min(1, width)]
    assert cut[0].confidences == (0.9, 0.9, 0.2)[:width]
    assert width < 3


def test_eliminate_uses_alpha_powers_for_rows_without_confidences():
    ctl = _controller(rows=1)
    alpha = ctl.plan.estimators[0][0].alpha
    [cut] = ctl.eliminate([Proposal(torch.arange(4)[None])], (0,), spent_ms=0.0)
    assert cut.k == best_width([[alpha ** j for j in range(1, 5)]], 0.0, linear)


def test_observe_updates_the_rows_alpha_and_the_calibration():
    ctl = _controller()
    before = sum(ctl.calibrator.trials)
    ctl.observe((0, 0), (2, 0), (2, 0), [(0.9, 0.9), ()])
    assert sum(ctl.calibrator.trials) == pytest.approx(before + 2)
    assert ctl.plan.estimators[0][0].alpha > ctl.plan.estimators[0][1].alpha


def test_stop_rule_predicts_the_next_column_from_the_real_confidences():
    stop = _controller().stop_rule(2)
    assert not stop(1, [(0.99,), (0.99,)], [True, True])  # ĉ_2 = 0.99·0.7 ≈ 0.69 per row pays 6 ms
    assert stop(1, [(0.1,), (0.1,)], [True, True])  # ĉ_2 ≈ 0.07 does not
    assert stop(1, [(0.99,), (0.99,)], [False, False])  # nothing can grow


# --- the draft loop and the engine ------------------------------------------------------------------

def test_batch_draft_stop_rule_and_confidences(tiny_factory):
    draft = tiny_factory(1)
    rows = BatchRows((torch.tensor([5, 6, 7, 8]), torch.tensor([0, 9, 10, 11])), (0, 1))
    calls = []

    def stop(j, confidences, growing):
        calls.append((j, [len(c) for c in confidences], list(growing)))
        return j == 2

    proposer = BatchDraftModelProposer(draft, 2, LogitsProcessorList(), False, 0)
    proposals = proposer.propose(rows, [5, 1], stop=stop)
    assert [p.k for p in proposals] == [2, 1]
    assert calls == [(1, [1, 1], [True, False]), (2, [2, 1], [True, False])]
    with torch.no_grad():
        first = torch.softmax(draft(torch.tensor([[5, 6, 7, 8]])).logits[0, -1], dim=-1)  # [V]
    assert proposals[0].confidences[0] == pytest.approx(float(first.max()), rel=1e-5)
    assert int(proposals[0].tokens[0, 0]) == int(first.argmax())


class _Recorder:
    """A controller whose ``eliminate`` cuts every proposal to 1 token and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def eliminate(self, proposals, drafters, spent_ms):
        self.calls += 1
        return [p.head(1) for p in proposals]


class _Drafter:
    name = "fake"

    def propose(self, rows, ks, stop=None):
        return [_proposal(k, (0.5,) * k) for k in ks]


@pytest.mark.parametrize("greedy", [True, False])
def test_engine_eliminates_for_greedy_decoding_only(greedy):
    controller = _Recorder()
    decision = BatchDecision((3, 2), (0, 0), (0.5, 0.5), 1.0)
    rows = BatchRows((torch.tensor([1, 2]), torch.tensor([3, 4])), (0, 0))
    proposals = _propose([_Drafter()], rows, decision, controller, greedy)
    assert [p.k for p in proposals] == ([1, 1] if greedy else [3, 2])
    assert controller.calls == int(greedy)
