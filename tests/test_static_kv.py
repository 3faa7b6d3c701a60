"""The preallocated KV cache (``backend.static_kv``, ``backend.stores.StaticStore``) computes what the dynamic
one does, on the tiny fp32 Llamas of conftest: the same logits under random appends with holes, rollbacks and
rows leaving, through compaction and moves to a wider arena; the same greedy tokens through ``generate`` when
rows stop at different times; a seeded draft prefix; recordings made once per width and replayed (on a CPU the
recordings are ``graphs.Rerun`` stand-ins, the CUDA graphs' static-buffer contract without a GPU); and the
architecture guard. Greedy equality with plain generate and the chi-square on sampling run over both caches in
tests/test_invariants.py."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import left_padded, slow_except

import hf_adaspec
from hf_adaspec import CostTable, SpeculationState
from hf_adaspec.backend import arena_sizes, static_kv
from hf_adaspec.backend.arenas import arenas_of
from hf_adaspec.backend.draft_prefix import DraftPrefixStore
from hf_adaspec.backend.graphs import Rerun
from hf_adaspec.backend.ragged import RaggedCache
from hf_adaspec.backend.stores import DynamicStore, StaticStore, open_store, store_kind

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)


def _pair(model, batch: int, capacity: int, graph_width: int = 4) -> tuple[RaggedCache, RaggedCache]:
    """The same batch on a dynamic cache and on an arena of ``capacity`` columns (role "test")."""
    static = StaticStore(model, batch, capacity, "test", graph_width)
    return RaggedCache(model, batch), RaggedCache(model, batch, store=static)


def _same(a: RaggedCache, b: RaggedCache, tokens: torch.Tensor, valid: torch.Tensor) -> None:
    """Both caches take the block; each valid position's logits agree (padding columns' logits are unused)."""
    got = [c.append(tokens, valid, tokens.shape[1]) for c in (a, b)]
    assert torch.allclose(got[0][valid], got[1][valid], atol=3e-5), (got[0][valid] - got[1][valid]).abs().max()
    assert torch.equal(a.lengths, b.lengths)


# fast: seed 0, with and without padding; the other seeds' schedules are slow
@pytest.mark.parametrize(
    "seed,pad",
    [
        (0, False),
        pytest.param(1, False, marks=pytest.mark.slow),
        pytest.param(2, False, marks=pytest.mark.slow),
        (0, True),
        pytest.param(1, True, marks=pytest.mark.slow),
    ],
)
def test_random_appends_rollbacks_and_leaving_rows_match_the_dynamic_cache(models, seed, pad, monkeypatch):
    """A random schedule on 3 rows: ragged blocks of 1–6 columns (some rows without tokens), rollbacks of the
    last columns of random rows (holes), a row leaving; a 40-column arena must compact and then move. ``pad``:
    the arenas (graph width 8) run blocks padded to the bucket widths 1, 2, 3, 5, 8, as on a GPU."""
    monkeypatch.setattr(static_kv, "PAD_DEVICES", frozenset({"cpu"} if pad else ()))
    gen = torch.Generator().manual_seed(seed)
    model = models["target"]
    dyn, sta = _pair(model, 3, capacity=40, graph_width=8 if pad else 4)
    prompt = torch.randint(1, 64, (3, 7), generator=gen)
    _same(dyn, sta, prompt, torch.arange(7)[None, :] >= torch.tensor([[0], [3], [5]]))  # left padding
    arenas = {id(sta.store.arena)}
    for step in range(30):
        width = int(torch.randint(1, 7, (1,), generator=gen))
        rows = dyn.batch
        tokens = torch.randint(1, 64, (rows, width), generator=gen)
        counts = torch.randint(0, width + 1, (rows,), generator=gen)
        counts[0] = width  # some row has a token in the last column
        _same(dyn, sta, tokens, torch.arange(width)[None, :] < counts[:, None])
        keep = dyn.lengths - torch.randint(0, width + 1, (rows,), generator=gen).clamp_max(counts)
        for c in (dyn, sta):
            c.rollback(keep)
        if step == 12 and rows > 1:  # the middle row leaves
            for c in (dyn, sta):
                c.select(torch.tensor([0, 2]))
        arenas.add(id(sta.store.arena))
    assert len(arenas) > 1  # it outgrew the 40-column arena
    assert sta.store.arena.capacity > 40 and sta.mask.shape[1] <= sta.store.arena.capacity


def test_compaction_moves_each_rows_tokens_to_the_left(models):
    """Holes in every row, then a block that does not fit: the rows' tokens are gathered left, the mask says so,
    and the next logits still match the dynamic cache's."""
    model = models["target"]
    dyn, sta = _pair(model, 2, capacity=15)
    _same(dyn, sta, torch.randint(1, 64, (2, 6)), torch.ones(2, 6, dtype=torch.bool))
    for dropped in ([1, 3], [3, 1]):  # 4 drafted columns, each row keeps 3 once and 1 once: holes in both
        _same(dyn, sta, torch.randint(1, 64, (2, 4)), torch.ones(2, 4, dtype=torch.bool))
        for c in (dyn, sta):
            c.rollback(c.lengths - torch.tensor(dropped))
    assert sta.mask.shape[1] == 12 and sta.lengths.tolist() == [10, 10]
    _same(dyn, sta, torch.randint(1, 64, (2, 4)), torch.ones(2, 4, dtype=torch.bool))  # 12 + 4 > 15: compact
    assert sta.store.arena.capacity == 15  # compaction was enough
    assert sta.mask.tolist() == [[1] * 14, [1] * 14]


@pytest.mark.parametrize("drafter", slow_except(["draft_model", "prompt_lookup"], fast={"draft_model"}))
def test_rows_stopping_at_different_times_match_the_dynamic_cache(models, drafter):
    """EOS ends rows at different steps; their arena slots stay masked while the others go on."""
    prompts = ([5, 6, 7, 8, 9, 10] * 4, [11, 12, 13], [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 8])
    draft = {"assistant_model": models["noisy_copy"]} if drafter == "draft_model" else {}
    plain = models["target"].generate(**left_padded(prompts), max_new_tokens=30, do_sample=False)
    eos = int(plain[1, -20])  # a token row 1 emits early
    out = {
        kv: models["target"].generate(
            **left_padded(prompts),
            **draft,
            speculation="adaptive",
            speculation_costs=COSTS,
            speculation_state=SpeculationState(),
            max_new_tokens=30,
            do_sample=False,
            eos_token_id=eos,
            kv_cache=kv,
            return_dict_in_generate=True,
        )
        for kv in ("dynamic", "static")
    }
    finish = out["static"].speculation.row_tokens
    assert len(set(finish)) > 1  # rows left at different times
    assert torch.equal(out["dynamic"].sequences, out["static"].sequences)


def test_a_seeded_arena_starts_from_the_prefix_and_exports_it(models):
    """The draft prefix store's copy seeds an arena row; what the arena exports holds the same keys."""
    model, tokens = models["target"], torch.randint(1, 64, (1, 9))
    fresh = RaggedCache(model, 1, store=StaticStore(model, 1, 32, "test", 4))
    fresh.append(tokens, torch.ones(1, 9, dtype=torch.bool), 1)
    exported = fresh.export_prefix()
    store = DraftPrefixStore()
    store.remember(model, tokens[0].tolist(), 9, 0, exported)
    seed = store.seed(model, torch.cat([tokens[0, :6], torch.tensor([60, 61])]))
    assert seed.length == 6
    seeded = RaggedCache(model, 1, store=StaticStore(model, 1, 32, "test-seeded", 4, seed.cache))
    dynamic = RaggedCache(model, 1)
    dynamic.append(tokens[:, :6], torch.ones(1, 6, dtype=torch.bool), 1)
    assert seeded.lengths.tolist() == [6] and seeded.mask.shape == (1, 6)
    _same(dynamic, seeded, torch.tensor([[60, 61]]), torch.ones(1, 2, dtype=torch.bool))


def test_each_width_is_recorded_once_and_replayed_across_requests(tiny_factory):
    """Recordings are made at a width's first use and reused by later requests with the same arena sizes;
    wider forwards (the prompt) run eagerly; a width's replays go through the recording."""
    model = hf_adaspec.enable(tiny_factory(0))
    replays = []

    class Counting(Rerun):
        def __call__(self, fn):
            captured, out = super().__call__(fn)
            original = captured.replay
            captured.replay = lambda: replays.append(1) or original()
            return captured, out

    arena = static_kv.Arena(model, 1, 256, Counting(), choose_by_time=False)
    arenas_of(model).drop()
    arenas_of(model).adopt("target", arena)
    for _ in range(2):
        model.generate(
            torch.tensor([[5, 6, 7, 8, 9, 10] * 4]),
            speculation="fixed",
            num_speculative_tokens=3,
            speculation_costs=COSTS,
            speculation_state=SpeculationState(),
            max_new_tokens=20,
            do_sample=False,
            kv_cache="static",
        )
    widths = sorted(r.width for r in arena.records)
    assert widths == sorted(set(widths)) and set(widths) <= {1, 2, 3, 4}  # once each; the 24-token prompt eager
    assert len(replays) > 2 * len(widths)  # both requests replayed
    assert all(r.kept and r.capture_ms >= 0 and r.batch == 1 and r.capacity == 256 for r in arena.records)
    assert all(r.eager_ms is None and r.replay_ms is None for r in arena.records)  # no timing forwards ran


def test_run_width_pads_narrow_blocks_to_the_graph_width_where_they_fit():
    assert arena_sizes.width_buckets(9) == (1, 2, 3, 5, 9) and arena_sizes.width_buckets(5) == (1, 2, 3, 5)
    assert arena_sizes.width_buckets(1) == (1,) and arena_sizes.width_buckets(12) == (1, 2, 3, 5, 9, 12)
    widths = [arena_sizes.run_width(n, 10, 9, 256, pad=True) for n in (1, 2, 3, 4, 5, 6, 8, 9, 10, 40)]
    assert widths == [1, 2, 3, 5, 5, 9, 9, 9, 10, 40]
    assert [arena_sizes.run_width(n, 10, 9, 256, pad=False) for n in (1, 2, 4, 9)] == [1, 2, 4, 9]
    assert arena_sizes.run_width(6, 250, 9, 256, pad=True) == 6  # 250 + 9 columns do not fit: its own width


@pytest.mark.slow  # the fast suite keeps ..._match_the_dynamic_cache[0-True] and test_capture_safety's [llama] case
def test_padded_arenas_record_two_widths_and_keep_greedy_tokens(models, monkeypatch):
    """Arenas that pad (as on a GPU) record only the bucket widths for the target and the draft whatever k the
    controller picks, and give the tokens of the dynamic cache."""
    monkeypatch.setattr(static_kv, "PAD_DEVICES", frozenset({"cpu"}))
    target, draft = models["target"], models["noisy_copy"]
    for model in (target, draft):
        arenas_of(model).drop()
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])
    out = {
        kv: target.generate(
            prompt,
            assistant_model=draft,
            speculation="adaptive",
            speculation_costs=COSTS,
            speculation_state=SpeculationState(),
            max_new_tokens=40,
            do_sample=False,
            kv_cache=kv,
            return_dict_in_generate=True,
            max_slowdown=math.inf,
        )
        for kv in ("dynamic", "static")
    }
    assert torch.equal(out["dynamic"].sequences, out["static"].sequences)
    ks = {s.k for s in out["static"].speculation.steps}
    assert len(ks - {0}) > 1  # verifications of several widths ran
    widths = {r.width for model in (target, draft) for r in arenas_of(model).records()}
    graph_width = max(r.width for r in arenas_of(target).records())
    assert widths <= set(arena_sizes.width_buckets(graph_width)) and graph_width > max(ks - {0})
    assert 4 not in widths and {k + 1 for k in ks} - widths  # some widths ran padded


def test_a_padding_arena_records_its_widths_when_a_request_opens_it(models, monkeypatch):
    """As on a GPU: opening a store records the bucket widths for the request's feature layers
    before any forward (so no step of the request pays a capture), once per arena; a seed copied in after
    the recordings still serves its prefix."""
    monkeypatch.setattr(static_kv, "PAD_DEVICES", frozenset({"cpu"}))
    model, tokens = models["target"], torch.randint(1, 64, (1, 10))
    arenas_of(model).drop()
    store = StaticStore(model, 1, 32, "test", 5, layers=(1,))
    assert sorted(store.arena.recordings) == [(w, (1,)) for w in (1, 2, 3, 5)] and len(store.arena.records) == 4
    StaticStore(model, 1, 32, "test", 5, layers=(1,))
    assert len(store.arena.records) == 4  # the next request finds them
    dynamic, fresh = RaggedCache(model, 1), RaggedCache(model, 1, store=StaticStore(model, 1, 32, "test-seed", 5))
    for cache in (dynamic, fresh):
        cache.append(tokens[:, :6], torch.ones(1, 6, dtype=torch.bool), 1)
    seeded = RaggedCache(model, 1, store=StaticStore(model, 1, 32, "test-seeded-pad", 5, fresh.export_prefix()))
    _same(dynamic, seeded, tokens[:, 6:10], torch.ones(1, 4, dtype=torch.bool))  # 4 columns run padded to 5


def test_a_slower_replay_is_dropped_for_the_eager_forward(tiny_factory):
    """With ``choose_by_time``, a width whose replay measures no faster than its eager forward runs eagerly
    (on a CPU the re-run stand-in always measures slower than one forward)."""
    model = hf_adaspec.enable(tiny_factory(0))
    arenas_of(model).drop()
    arenas_of(model).adopt("target", static_kv.Arena(model, 1, 256, Rerun(), choose_by_time=True))
    out = model.generate(
        torch.tensor([[5, 6, 7, 8]]),
        speculation="fixed",
        num_speculative_tokens=2,
        speculation_costs=COSTS,
        speculation_state=SpeculationState(),
        max_new_tokens=8,
        do_sample=False,
        kv_cache="static",
    )
    plain = model.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=8, do_sample=False)
    arena = arenas_of(model).kept("target", 1, 256)
    assert torch.equal(out, plain) and arena.records
    assert all(arena.recordings[(r.width, r.layers)] is None for r in arena.records if not r.kept)


def test_capacity_buckets_and_store_choice(models):
    assert arena_sizes.capacity_for(10) == 512 and arena_sizes.capacity_for(0, 0) == 256
    assert arena_sizes.capacity_for(300, 300) == 1024
    with pytest.raises(ValueError, match="context and new tokens"):
        arena_sizes.capacity_for(-1)
    model = models["target"]
    assert store_kind(model, "auto") == "dynamic"  # a CPU: the dynamic cache
    assert store_kind(model, "static") == "static"
    assert isinstance(open_store(model, 2, "auto", 256, "test", 4), DynamicStore)


def test_sliding_window_architectures_get_an_arena_and_recurrent_ones_are_refused():
    import transformers

    config = transformers.Gemma3TextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = transformers.Gemma3ForCausalLM(config).eval()
    assert (store_kind(model, "auto"), store_kind(model, "static")) == ("dynamic", "static")  # a CPU: dynamic
    mamba = transformers.MambaForCausalLM(
        transformers.MambaConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, state_size=4, expand=2, conv_kernel=2
        )
    )
    assert store_kind(mamba, "auto") == "dynamic"
    with pytest.raises(ValueError, match=r"kv_cache='static' cannot serve .*use kv_cache='dynamic'"):
        store_kind(mamba, "static")


def test_compile_steps_validates_its_widths_and_keys_the_costs(tiny_factory):
    from hf_adaspec.costs.table import pair_identity

    model = tiny_factory(0)
    for bad in ((0,), (66,), (True,), (1.0,)):
        with pytest.raises(ValueError, match="widths must be integers in 1..65"):
            hf_adaspec.compile_steps(model, bad)
    plain = pair_identity(model, None, "static")
    assert hf_adaspec.compile_steps(model, (1,)) is model and arenas_of(model).compiled == {1}
    assert pair_identity(model, None, "static") == {**plain, "compiled": {"target": [1]}}
    hf_adaspec.compile_steps(model, ())
    assert pair_identity(model, None, "static") == plain


@pytest.mark.slow
def test_a_compiled_recording_gives_plain_greedy_tokens(tiny_factory):
    """The width-1 forward recorded after torch.compile (inductor on the CPU: seconds) drafts as before."""
    model, draft = hf_adaspec.enable(tiny_factory(0)), hf_adaspec.compile_steps(tiny_factory(0), (1,))
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])
    out = model.generate(
        prompt,
        assistant_model=draft,
        speculation="fixed",
        num_speculative_tokens=3,
        speculation_costs=COSTS,
        speculation_state=SpeculationState(),
        max_new_tokens=16,
        do_sample=False,
        kv_cache="static",
    )
    assert torch.equal(out, model.generate(prompt, max_new_tokens=16, do_sample=False))
    records = arenas_of(draft).records()
    assert any(r.compiled and r.width == 1 for r in records) and not any(r.compiled and r.width != 1 for r in records)
