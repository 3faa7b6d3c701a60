"""The mode registry and the drafter interface: every mode name has one registry entry, drafters are
identified by their specs, the interface has three calls, and none of them depends on another's leftovers
(a costless drafter keeps nothing between calls; hindsight scores the step's offer, never a second propose)."""

from __future__ import annotations

import inspect

import pytest
import torch
from conftest import PlainController
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

from hf_adaspec import SpeculationConfig, SpeculationState
from hf_adaspec.backend.ragged import RaggedCache
from hf_adaspec.config import SPECULATION_MODES
from hf_adaspec.costs.table import CostTable
from hf_adaspec.engine.loop import speculative_decode
from hf_adaspec.engine.run import build_run
from hf_adaspec.engine.settings import DecodeSettings, RunParts
from hf_adaspec.policy.modes import (
    DRAFT_HEAD,
    DRAFT_MODEL,
    MODES,
    PROMPT_LOOKUP,
    SUFFIX,
    DrafterContext,
    assistant_kind,
)
from hf_adaspec.proposers import Drafter, DraftModelProposer, PromptLookupProposer, Rows, SuffixMemory, SuffixProposer

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24], repetitive so the costless drafters offer tokens


def test_every_mode_name_has_one_registry_entry():
    assert set(MODES) == set(SPECULATION_MODES)


@pytest.mark.parametrize(
    "mode, assistant, expected",
    [
        ("adaptive", "model", (DRAFT_MODEL, PROMPT_LOOKUP, SUFFIX)),
        ("adaptive", "head", (DRAFT_HEAD, PROMPT_LOOKUP, SUFFIX)),
        ("adaptive", None, (PROMPT_LOOKUP, SUFFIX)),
        ("fixed", "model", (DRAFT_MODEL,)),
        ("fixed", "head", (DRAFT_HEAD,)),
        ("fixed", None, (PROMPT_LOOKUP,)),
    ],
)
def test_the_registry_says_which_drafters_a_mode_uses(models, tiny_head, mode, assistant, expected):
    given = {"model": models["noisy_copy"], "head": tiny_head, None: None}[assistant]
    assert assistant_kind(given) == assistant and MODES[mode].drafters(given) == expected


def test_the_drafter_interface_has_three_calls():
    calls = {name for name, member in vars(Drafter).items() if inspect.isfunction(member) and not name.startswith("_")}
    assert calls == {"offer", "propose", "commit"}


def _context(draft_cache=None) -> DrafterContext:
    return DrafterContext(
        1, SpeculationConfig(), LogitsProcessorList(), False, 0, (), None, draft_cache, SuffixMemory()
    )


@pytest.mark.parametrize("spec", [PROMPT_LOOKUP, SUFFIX])
def test_costless_drafters_offer_their_tokens_and_keep_nothing_between_calls(spec):
    drafter = spec.build(_context())
    assert drafter.name == spec.name and not spec.paid
    rows = Rows((PROMPT[0],), (0,), prompt_width=PROMPT.shape[1])
    first = drafter.offer(rows, 8)
    assert first.costless and first.bounds[0] > 0 and first.catchup == 0
    drafter.commit(torch.tensor([3]), keep=torch.tensor([0]))  # commit, another request's rows: no effect
    drafter.offer(Rows((torch.tensor([1, 2, 3, 1, 2]),), (0,), 3), 8)
    again = drafter.offer(rows, 8)
    assert again.bounds == first.bounds and again.evidence == first.evidence
    assert torch.equal(again.tokens[0], first.tokens[0])
    (proposal,) = drafter.propose(rows, first, [2])
    assert torch.equal(proposal.tokens[0], first.tokens[0][:2])


def test_the_draft_models_proposal_depends_on_its_cache_not_on_an_earlier_offer(tiny_factory, one_thread):
    draft = tiny_factory(1)
    rows = Rows((PROMPT[0],), (0,), prompt_width=PROMPT.shape[1])
    offered = DRAFT_MODEL.build(_context(RaggedCache(draft, 1)))
    offer = offered.offer(rows, 4)
    assert DRAFT_MODEL.paid and not offer.costless and offer.bounds == (4,) and offer.catchup == 24 - 2
    assert offered.offer(rows, 4) == offer  # asking twice changes nothing
    fresh = DraftModelProposer(RaggedCache(draft, 1), LogitsProcessorList(), False, 0)  # never asked to offer
    (a,), (b,) = offered.propose(rows, offer, [4]), fresh.propose(rows, offer, [4])
    assert a.k == 4 and torch.equal(a.tokens, b.tokens)


def test_the_draft_model_spec_needs_a_draft_model():
    with pytest.raises(ValueError, match="assistant_model"):
        DRAFT_MODEL.build(_context())


class _CountingLookup(PromptLookupProposer):
    proposed = 0

    def propose(self, rows, offer, ks, stop=None):
        self.proposed += 1
        return super().propose(rows, offer, ks, stop)


def test_hindsight_scores_the_steps_offer_without_proposing_again(models, one_thread):
    lookup, controller = _CountingLookup(), PlainController()
    settings = DecodeSettings(LogitsProcessorList(), StoppingCriteriaList([MaxLengthCriteria(24 + 10)]), 24 + 10, False)
    speculative_decode(
        RunParts(RaggedCache(models["target"], 1), (lookup,), controller, settings, 8), PROMPT, torch.ones_like(PROMPT)
    )
    scored = [o.hindsight[0][0] for o in controller.outcomes]
    assert lookup.proposed == 0 and len(scored) == 9  # 9 plain steps after the prefill's token
    assert any(compared > 0 for compared, _ in scored)  # the offers were scored against what was emitted


def test_build_run_takes_drafters_and_prices_from_the_registry(models):
    state = SpeculationState()
    settings = DecodeSettings(LogitsProcessorList(), StoppingCriteriaList(), 40, False)

    class Caches:
        def target(self, batch, layers=()):
            return RaggedCache(models["target"], batch)

        def draft(self, batch, seed):
            return RaggedCache(models["noisy_copy"], batch, seed.cache if seed is not None else None)

    run = build_run(
        SpeculationConfig(),
        state,
        PROMPT,
        torch.ones_like(PROMPT),
        models["noisy_copy"],
        Caches(),
        lambda b: CostTable((10.0, 11.0), 2.0),
        settings,
    )
    assert run.specs == MODES["adaptive"].drafters(models["noisy_copy"]) and run.seed is not None
    assert run.seed.length == 0 and run.parts.feature_layers == ()
    assert [type(d) for d in run.parts.drafters] == [DraftModelProposer, PromptLookupProposer, SuffixProposer]
    assert run.parts.controller.paid == [True, False, False] and run.parts.k_max == 8
