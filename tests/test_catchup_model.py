"""The draft's dense copy for long catch-ups (``assistant_catchup_model``): when it runs, what it
computes, that output stays the target's, and the errors."""

import copy

import pytest
import torch

from hf_adaspec.costs import CostTable
from hf_adaspec.integration import SpeculationState
from hf_adaspec.proposers.draft_model import CATCHUP_MODEL_MIN_TOKENS, DraftModelProposer

COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0, draft_catchup_ms=0.01)
LONG = CATCHUP_MODEL_MIN_TOKENS + 6  # prompt tokens: the first catch-up goes through the copy


def spy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` recording in ``model.calls`` the number of new tokens of every forward."""
    model.calls = []
    model.register_forward_pre_hook(lambda m, args, kwargs: m.calls.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    return model


def prompt(n: int) -> torch.Tensor:
    return torch.randint(1, 64, (1, n), generator=torch.Generator().manual_seed(n))


def greedy(scores_ids, logits):
    return logits


def test_long_pending_chunk_goes_through_the_copy_and_drafting_through_the_draft(models, one_thread):
    draft, copy_spy = spy(copy.deepcopy(models["noisy_copy"])), spy(copy.deepcopy(models["noisy_copy"]))
    proposer = DraftModelProposer(draft, greedy, do_sample=False, catchup_model=copy_spy)
    tokens = prompt(LONG)
    proposer.propose(tokens, 3)
    assert copy_spy.calls == [LONG] and draft.calls == [1, 1]  # catch-up by the copy, two more drafts
    proposer.rollback(LONG)
    proposer.propose(torch.cat([tokens, prompt(2)[:, :1]], dim=1), 2)  # one pending token: the draft ingests it
    assert copy_spy.calls == [LONG] and draft.calls == [1, 1, 1, 1]


def test_short_pending_chunk_stays_on_the_draft(models, one_thread):
    draft, copy_spy = spy(copy.deepcopy(models["noisy_copy"])), spy(copy.deepcopy(models["noisy_copy"]))
    proposer = DraftModelProposer(draft, greedy, do_sample=False, catchup_model=copy_spy)
    proposer.propose(prompt(CATCHUP_MODEL_MIN_TOKENS - 1), 2)
    assert copy_spy.calls == [] and draft.calls == [CATCHUP_MODEL_MIN_TOKENS - 1, 1]


def test_a_copy_of_the_same_weights_proposes_the_same_tokens(models, one_thread):
    draft, tokens = models["noisy_copy"], prompt(LONG)
    alone = DraftModelProposer(draft, greedy, do_sample=False).propose(tokens, 4)
    with_copy = DraftModelProposer(draft, greedy, do_sample=False, catchup_model=copy.deepcopy(draft)).propose(tokens, 4)
    assert torch.equal(alone.tokens, with_copy.tokens)
    assert alone.confidences == pytest.approx(with_copy.confidences)


def test_sampled_q_is_the_distribution_of_the_model_that_drew_the_token(models, one_thread):
    draft, other = models["noisy_copy"], models["other_seed"]
    tokens = prompt(LONG)
    proposer = DraftModelProposer(draft, greedy, do_sample=True, generator=torch.Generator().manual_seed(0),
                                  catchup_model=other)
    proposal = proposer.propose(tokens, 1)
    with torch.no_grad():
        want = torch.softmax(other(input_ids=tokens).logits[:, -1].float(), dim=-1)  # [1, V]
    torch.testing.assert_close(proposal.q[:, 0], want)
    assert proposal.confidences[0] == pytest.approx(float(want[0, proposal.tokens[0, 0]]))


@pytest.mark.parametrize("mode", ["adaptive", "confidence", "hybrid-confidence"])
def test_greedy_output_is_the_target_s_even_with_a_wrong_copy(models, one_thread, private_cache, mode):
    target, draft = models["target"], models["noisy_copy"]
    inputs = {"input_ids": prompt(LONG), "attention_mask": torch.ones(1, LONG, dtype=torch.long)}
    plain = target.generate(**inputs, max_new_tokens=24, do_sample=False)
    wrong = spy(copy.deepcopy(models["other_seed"]))  # a catch-up model with other weights: worse drafts, same output
    out = target.generate(**inputs, max_new_tokens=24, do_sample=False, speculation=mode, assistant_model=draft,
                          assistant_catchup_model=wrong, speculation_costs=COSTS, return_dict_in_generate=True,
                          speculation_state=SpeculationState())  # no reused draft prefix: the whole prompt is pending
    assert torch.equal(out.sequences, plain)
    assert wrong.calls and wrong.calls[0] >= CATCHUP_MODEL_MIN_TOKENS


def test_catchup_model_errors_name_the_fix(models, tiny_factory, one_thread, private_cache):
    target, draft = models["target"], models["noisy_copy"]
    inputs = {"input_ids": prompt(8), "attention_mask": torch.ones(1, 8, dtype=torch.long)}
    with pytest.raises(ValueError, match="pass assistant_model=draft too"):
        target.generate(**inputs, max_new_tokens=2, speculation="adaptive", assistant_catchup_model=draft)
    with pytest.raises(ValueError, match="quantization='none'"):
        target.generate(**inputs, max_new_tokens=2, speculation="adaptive", assistant_model=draft,
                        assistant_catchup_model=tiny_factory(3, vocab_size=80), speculation_costs=COSTS)
    with pytest.raises(ValueError, match="draft's dtype"):
        DraftModelProposer(draft, greedy, do_sample=False, catchup_model=copy.deepcopy(draft).to(torch.bfloat16))
    batch = {"input_ids": prompt(8).repeat(2, 1), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    with pytest.raises(ValueError, match="batch size 1"):
        target.generate(**batch, max_new_tokens=2, speculation="adaptive", assistant_model=draft,
                        assistant_catchup_model=copy.deepcopy(draft), speculation_costs=COSTS)
