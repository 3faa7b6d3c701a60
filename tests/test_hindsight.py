"""Hindsight trials of prompt lookup: its unverified proposal scored against the tokens a step emitted,
what the controllers learn from them, and the engine handing them over on tiny random Llamas."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

from hf_adaspec.acceptance import AcceptancePrior
from hf_adaspec.bench import METHOD_FAMILY, method_kwargs
from hf_adaspec.confidence import ConfidenceCalibrator
from hf_adaspec.config import SpeculationConfig
from hf_adaspec.controller import Decision, DraftOption, DrafterCosts, GoodputController
from hf_adaspec.costs import CostTable
from hf_adaspec.engine import DecodeSettings, speculative_decode
from hf_adaspec.hindsight import HindsightTrial, hindsight_trial, unverified_proposals
from hf_adaspec.hybrid_confidence import DRAFT, LOOKUP, HybridConfidenceController
from hf_adaspec.proposers import DraftModelProposer, PromptLookupProposer
from hf_adaspec.proposers.prompt_lookup import find_continuation
from hf_adaspec.verification import speculative_sample

FLAT = CostTable(verify_ms=(50.0,) * 9, draft_ms=20.0)
COSTS = [DrafterCosts(draft_ms=20.0, catchup_ms=2.0), DrafterCosts()]  # draft model, prompt lookup
PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]


def _t(*tokens: int) -> torch.Tensor:
    return torch.tensor(tokens)


@pytest.mark.parametrize(("proposed", "emitted", "expected"), [
    ((1, 2, 3, 4), (1, 2, 9), HindsightTrial(3, 2)),  # rejected at the third token
    ((7, 2), (1, 2, 3), HindsightTrial(2, 0)),  # rejected at once
    ((1, 2, 3, 4, 5), (1, 2), HindsightTrial(2, 2)),  # the step emitted 2: no rejection seen past them
    ((1, 2), (1, 2, 3, 4), HindsightTrial(2, 2)),  # the whole proposal would have been accepted
])
def test_trial_is_the_common_prefix_of_proposal_and_emitted_tokens(proposed, emitted, expected):
    assert hindsight_trial(_t(*proposed), _t(*emitted)) == expected


class _Lookup(PromptLookupProposer):
    """Prompt lookup that counts its proposals."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def propose(self, tokens, k):
        self.calls += 1
        return super().propose(tokens, k)


def test_only_costless_drafters_that_are_not_verified_are_proposed():
    draft, lookup = object(), _Lookup()  # the draft model is never asked: it is not costless
    ids = torch.tensor([[1, 2, 3, 1, 2, 4, 1, 2]])
    options = [DraftOption(DRAFT, 8), DraftOption(LOOKUP, 2)]
    plain, by_draft = Decision(0, DRAFT, 0.5, 1.0), Decision(3, DRAFT, 0.5, 1.0)
    for decision in (plain, by_draft):
        out = unverified_proposals([draft, lookup], options, decision, ids)
        assert list(out) == [LOOKUP] and out[LOOKUP].tolist() == [4, 1]  # after the latest "1 2": 4, 1
    assert unverified_proposals([draft, lookup], options, Decision(2, LOOKUP, 0.5, 1.0), ids) == {}
    assert unverified_proposals([draft, lookup], [options[0], DraftOption(LOOKUP, 0)], plain, ids) == {}
    assert lookup.calls == 2


def test_goodput_controller_learns_lookup_alpha_from_hindsight():
    def controller() -> GoodputController:
        return GoodputController(FLAT, COSTS, [AcceptancePrior(0.8, 2.0), AcceptancePrior(0.37, 2.0)],
                                 hindsight=True)

    assert controller().hindsight and not GoodputController(FLAT, COSTS).hindsight
    matched, rejected = controller(), controller()
    matched.observe_hindsight(LOOKUP, HindsightTrial(4, 4))
    rejected.observe_hindsight(LOOKUP, HindsightTrial(4, 0))
    assert matched.estimators[LOOKUP].alpha == pytest.approx((0.37 * 2 + 4) / (2 + 4))
    assert rejected.estimators[LOOKUP].alpha == pytest.approx(0.37 * 2 / (2 + 1))
    assert matched.estimators[DRAFT].alpha == rejected.estimators[DRAFT].alpha == pytest.approx(0.8)


def test_hybrid_confidence_turns_to_lookup_once_hindsight_shows_it_is_accepted():
    calibrator = ConfidenceCalibrator(prior_strength=1e6, token_mean=0.85, optimism=0.0)
    ctl = HybridConfidenceController(FLAT, COSTS, calibrator, AcceptancePrior(0.1, 2.0), hindsight=True)
    options = [DraftOption(DRAFT, 8), DraftOption(LOOKUP, 6)]
    assert ctl.choose(options, horizon=64).drafter == DRAFT
    trials = sum(ctl.calibrator.trials)
    for _ in range(4):
        ctl.observe_hindsight(LOOKUP, HindsightTrial(6, 6))  # lookup's proposals all matched the emitted tokens
        ctl.observe_hindsight(DRAFT, HindsightTrial(6, 0))  # not a lookup trial: ignored
    assert sum(ctl.calibrator.trials) == trials
    decision = ctl.choose(options, horizon=64)
    assert (decision.drafter, decision.k) == (LOOKUP, 6) and decision.alpha > 0.8


class _DraftEveryStep:
    """Drafts k ≤ 2 with the draft model every step, keeping the hindsight trials it is given."""

    hindsight = True

    def __init__(self) -> None:
        self.trials: list[tuple[int, HindsightTrial]] = []
        self.offered: list[int] = []

    def choose(self, options, horizon=1):
        self.offered.append(options[LOOKUP].k_upper)
        return Decision(min(2, options[DRAFT].k_upper), DRAFT, 0.5, math.nan)

    def observe(self, drafter, drafted, accepted, confidences=()):
        pass

    def observe_hindsight(self, drafter, trial):
        self.trials.append((drafter, trial))


@pytest.mark.usefixtures("one_thread")
def test_engine_scores_lookup_on_every_step_it_offered_a_proposal(models):
    controller = _DraftEveryStep()
    proposers = [DraftModelProposer(models["noisy_copy"], LogitsProcessorList(), False), PromptLookupProposer()]
    settings = DecodeSettings(LogitsProcessorList(), StoppingCriteriaList([MaxLengthCriteria(24 + 30)]), 24 + 30,
                              False, 8)
    result = speculative_decode(models["target"], PROMPT, proposers, controller, settings)
    seq, length = result.sequences[0], PROMPT.shape[1] + 1  # the prefill emitted one token
    expected = []
    for step, offered in zip(result.stats.steps, controller.offered, strict=True):
        if offered:  # what lookup would have proposed here, against what the step emitted
            proposed = find_continuation(seq[:length], 3, 1, offered)
            emitted = seq[length : length + step.emitted]
            agree = [int(a) == int(b) for a, b in zip(proposed, emitted)]
            accepted = agree.index(False) if False in agree else len(agree)
            expected.append((LOOKUP, HindsightTrial(len(agree), accepted)))
        length += step.emitted
    assert controller.trials == expected and len(expected) > 3
    assert any(t.accepted for _, t in expected) and any(t.accepted < t.drafted for _, t in expected)


def test_hindsight_is_unbiased_under_speculative_sampling():
    """The emitted token equals a lookup token x with probability p(x), its acceptance probability."""
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])  # target, [V]
    q = torch.tensor([0.1, 0.6, 0.2, 0.1])  # the draft model that was verified, [V]
    n, x = 20000, 1  # lookup would have proposed token 1
    draft = torch.multinomial(q, n, replacement=True, generator=gen)[:, None]  # [n, 1]
    probs = torch.cat([p, p]).view(1, 2, 4).expand(n, 2, 4)  # [n, k+1, V]
    result = speculative_sample(draft, q.view(1, 1, 4).expand(n, 1, 4), probs, gen)
    first = torch.where(result.num_accepted > 0, draft[:, 0], result.next_token)  # [n]: the first emitted token
    hits = sum(hindsight_trial(torch.tensor([x]), first[i : i + 1]).accepted for i in range(n))
    assert abs(hits / n - float(p[x])) < 4 * math.sqrt(0.3 * 0.7 / n)


def test_config_default_and_bench_ablation():
    assert not SpeculationConfig().lookup_hindsight
    for mode in ("adaptive-lookup", "hybrid", "hybrid-confidence"):
        on = {**method_kwargs(mode, "d", 5), "lookup_hindsight": True}
        assert method_kwargs(f"{mode}-hindsight", "d", 5) == on
        assert METHOD_FAMILY[f"{mode}-hindsight"] == METHOD_FAMILY[mode]


@pytest.mark.usefixtures("one_thread", "private_cache")
@pytest.mark.parametrize("mode", ["hybrid", "hybrid-confidence"])
def test_greedy_with_hindsight_equals_plain(models, mode):
    plain = models["target"].generate(PROMPT, max_new_tokens=40, do_sample=False)
    out = models["target"].generate(PROMPT, speculation=mode, assistant_model=models["noisy_copy"],
                                    lookup_hindsight=True, speculation_costs=FLAT, max_new_tokens=40,
                                    do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert {"draft_model", "prompt_lookup"} & {s.drafter for s in out.speculation.steps}
