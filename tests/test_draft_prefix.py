"""Draft prefix reuse (always on at batch size 1 with a draft model): the store's seeds, their caches, and
generate's use of them."""

import math

import pytest
import torch
from transformers import LogitsProcessorList

import hf_adaspec
from hf_adaspec.backend import hf_compat
from hf_adaspec.backend.draft_prefix import DraftPrefixStore, PrefixSeed, common_prefix_length
from hf_adaspec.backend.ragged import RaggedCache
from hf_adaspec.costs.table import CostTable
from hf_adaspec.proposers import DraftModelProposer, Rows

COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0, draft_catchup_ms=0.1)


def prefilled(model, tokens: torch.Tensor):
    """The model's cache after one forward over tokens [1, T]."""
    cache = hf_compat.new_cache(model)
    with torch.no_grad():
        hf_compat.forward_logits(model, tokens, cache, keep=1)
    return cache


def layer_keys(cache) -> list[torch.Tensor]:
    return [layer.keys.clone() for layer in cache.layers]


def test_common_prefix_length():
    a = torch.tensor([1, 2, 3, 4])
    assert common_prefix_length(a, torch.tensor([1, 2, 3, 4])) == 4
    assert common_prefix_length(a, torch.tensor([1, 2, 9, 4])) == 2
    assert common_prefix_length(a, torch.tensor([7, 2, 3])) == 0
    assert common_prefix_length(a, torch.tensor([1, 2])) == 2
    assert common_prefix_length(a, torch.tensor([], dtype=torch.long)) == 0


def test_seed_is_an_independent_copy_of_the_longest_shared_prefix(models, one_thread):
    draft, store = models["same_model"], DraftPrefixStore()
    assert store.seed(draft, torch.tensor([1, 2, 3])).length == 0  # nothing stored yet
    first = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    store.remember(draft, first[0].tolist(), 7, 0, prefilled(draft, first))
    stored = layer_keys(store.entries[0].cache)
    seed = store.seed(draft, torch.tensor([5, 6, 7, 8, 20, 21]))
    assert seed.length == 4 and hf_compat.cache_length(seed.cache) == 4
    fresh = prefilled(draft, torch.tensor([[5, 6, 7, 8]]))
    for got, want in zip(layer_keys(seed.cache), layer_keys(fresh)):
        torch.testing.assert_close(got, want)  # a position's keys depend only on the tokens before it
    hf_compat.rollback(seed.cache, 1)
    assert all(torch.equal(a, b) for a, b in zip(layer_keys(store.entries[0].cache), stored))  # store untouched


def test_seed_matches_only_the_same_model(models, one_thread):
    store, prompt = DraftPrefixStore(), torch.tensor([[5, 6, 7, 8]])
    store.remember(models["same_model"], prompt[0].tolist(), 4, 0, prefilled(models["same_model"], prompt))
    assert store.seed(models["other_seed"], prompt[0]).length == 0
    assert store.seed(models["same_model"], prompt[0]).length == 4


def test_a_store_of_token_ids_seeds_lengths_and_maps_ids():
    store, key = DraftPrefixStore(), type("StandIn", (), {})  # a draft's stand-in: any weakly referable object
    store.remember(key, [5, 6, 7, 8, 9], 4, 0, None)  # the replay keeps token ids, no cache
    assert store.seed(key, torch.tensor([5, 6, 7, 1])) == PrefixSeed(None, 3)
    mapped = store.mapped(lambda t: t + 100)
    assert mapped.seed(key, torch.tensor([105, 106, 9])).length == 2
    assert store.entries[0].tokens.tolist() == [5, 6, 7, 8]  # the store itself unchanged


def test_remember_keeps_grown_caches_and_forgets_the_oldest(models, one_thread):
    draft, store = models["same_model"], DraftPrefixStore(size=2)
    prompts = [torch.tensor([[i, 1, 2]]) for i in (10, 11, 12)]
    store.remember(draft, prompts[0][0].tolist(), 3, 3, prefilled(draft, prompts[0]))  # did not grow past its seed
    assert len(store.entries) == 0
    for p in prompts:
        store.remember(draft, p[0].tolist(), 3, 0, prefilled(draft, p))
    assert len(store.entries) == 2
    assert store.seed(draft, prompts[0][0]).length == 0 and store.seed(draft, prompts[2][0]).length == 3
    with pytest.raises(ValueError, match="size must be >= 1"):
        DraftPrefixStore(size=0)
    with pytest.raises(ValueError, match="length must be in"):
        hf_compat.copy_cache(prefilled(draft, prompts[0]), 4)


# adaptive without the slowdown bound: a fresh pair's draft must draft within 16 tokens, whatever it costs
MODES = {
    "adaptive": {"speculation": "adaptive", "max_slowdown": math.inf},
    "fixed": {"speculation": "fixed", "num_speculative_tokens": 3},
}


# slow, both modes: the fast suite keeps test_the_whole_prompt_is_reused_and_the_grown_cache_stored (a stored prefix
# reused by generate, greedy output plain's) and test_seed_is_an_independent_copy_of_the_longest_shared_prefix
@pytest.mark.parametrize("mode", [pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_a_shared_prefix_is_reused_and_greedy_output_equals_plain(tiny_factory, mode, one_thread):
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(1)
    prompts = [torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 3 + i]]) for i in range(3)]  # 8 shared tokens
    state = hf_adaspec.SpeculationState()
    reused = []
    for prompt in prompts:
        plain = target.generate(prompt, max_new_tokens=16, do_sample=False)
        out = target.generate(
            prompt,
            assistant_model=draft,
            **MODES[mode],
            speculation_costs=COSTS,
            speculation_state=state,
            max_new_tokens=16,
            do_sample=False,
            return_dict_in_generate=True,
        )
        assert torch.equal(out.sequences, plain)
        assert any(s.drafter == "draft_model" for s in out.speculation.steps)  # the seeded draft did draft
        reused.append(out.speculation.draft_prefix_tokens)
    assert reused == [0, 8, 8]
    assert "draft reused 8 prompt tokens" in out.speculation.summary()
    assert out.speculation.to_dict()["draft_prefix_tokens"] == 8


def test_the_whole_prompt_is_reused_and_the_grown_cache_stored(tiny_factory, one_thread):
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(0)
    prompt, state = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]]), hf_adaspec.SpeculationState()
    plain = target.generate(prompt, max_new_tokens=12, do_sample=False)

    def run() -> tuple[int, int]:
        out = target.generate(
            prompt,
            assistant_model=draft,
            speculation="adaptive",
            speculation_costs=COSTS,
            speculation_state=state,
            max_new_tokens=12,
            do_sample=False,
            return_dict_in_generate=True,
            max_slowdown=math.inf,
        )  # drafts from the first step
        assert torch.equal(out.sequences, plain)
        return out.speculation.draft_prefix_tokens, len(state.draft_prefixes.entries)

    assert run() == (0, 1)  # the first request stores its draft cache
    assert run() == (8, 2)  # the whole prompt reused; its cache grew past it, so it is stored too


def test_batches_neither_reuse_nor_store_draft_prefixes(tiny_factory, one_thread):
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(1)
    state, prompt = hf_adaspec.SpeculationState(), torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    kwargs = dict(
        assistant_model=draft,
        speculation="adaptive",
        speculation_costs=COSTS,
        speculation_state=state,
        max_new_tokens=6,
        do_sample=False,
        return_dict_in_generate=True,
        max_slowdown=math.inf,
    )
    assert target.generate(prompt, **kwargs).speculation.draft_prefix_tokens == 0
    assert len(state.draft_prefixes.entries) == 1
    batch = target.generate(prompt.repeat(2, 1), **kwargs)  # shares all 8 tokens with the stored request
    assert batch.speculation.draft_prefix_tokens == 0 and len(state.draft_prefixes.entries) == 1
    assert target.generate(prompt, **kwargs).speculation.draft_prefix_tokens == 8  # batch size 1 reuses again


def test_a_seeded_proposer_catches_up_only_on_the_rest(models, one_thread):
    draft, store = models["same_model"], DraftPrefixStore()
    first = torch.tensor([[5, 6, 7, 8, 9, 10]])
    store.remember(draft, first[0].tolist(), 6, 0, prefilled(draft, first))
    ids = torch.tensor([5, 6, 7, 8, 1, 2, 3, 4, 9])  # an 8-token prompt sharing 4, then the prefill's token
    rows = Rows((ids,), (0,), prompt_width=8)
    seed = store.seed(draft, ids[:8])
    seeded = DraftModelProposer(RaggedCache(draft, 1, seed.cache), LogitsProcessorList(), False, 0)
    fresh = DraftModelProposer(RaggedCache(draft, 1), LogitsProcessorList(), False, 0)
    offers = seeded.offer(rows, 4), fresh.offer(rows, 4)
    assert [o.catchup for o in offers] == [9 - 4 - 2, 9 - 2] and offers[0].bounds == (4,) and not offers[0].costless
    (a,), (b,) = seeded.propose(rows, offers[0], [4]), fresh.propose(rows, offers[1], [4])
    assert a.k == 4 and torch.equal(a.tokens, b.tokens)


def test_a_left_padded_single_request_can_be_repeated(tiny_factory, one_thread):
    target, draft = hf_adaspec.enable(tiny_factory(0)), tiny_factory(0)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9, 10, 11, 12]])  # one row, left-padded by two
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    plain = target.generate(ids[:, 2:], max_new_tokens=12, do_sample=False)[0, 8:]
    state = hf_adaspec.SpeculationState()
    for _ in range(2):
        out = target.generate(
            ids,
            attention_mask=mask,
            assistant_model=draft,
            speculation="adaptive",
            speculation_costs=COSTS,
            speculation_state=state,
            max_new_tokens=12,
            do_sample=False,
        )
        assert torch.equal(out[0, 10:], plain)  # a padded row neither seeds nor stores a draft prefix
