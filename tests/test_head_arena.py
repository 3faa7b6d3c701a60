"""A draft head's entries on the backend's arena (``backend.head_kv``): the same entries, outputs and logits as
the growing ``HeadCache`` through blocks, drafted columns, rollbacks, rows leaving and a move to a wider arena;
its drafted column recorded once and replayed across requests; and where ``kv_cache`` gives a head an arena. On
a CPU the recording is ``graphs.Rerun`` (the same static-buffer discipline as a CUDA graph). Greedy equality and
lossless sampling with the arena are in test_invariants.py's matrices (``kv_cache="static"``)."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_adaspec.backend import arena_sizes, arenas, static_kv
from hf_adaspec.backend.arenas import arenas_of
from hf_adaspec.backend.caches import open_head_cache
from hf_adaspec.backend.graphs import Rerun
from hf_adaspec.backend.head_kv import StaticHeadCache
from hf_adaspec.models.eagle3 import HeadCache

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingCapture:
    """``Rerun``, counting recordings and replays."""

    def __init__(self) -> None:
        self.recorded, self.replayed = 0, 0

    def __call__(self, fn):
        captured, out = Rerun()(fn)
        self.recorded += 1
        replay = captured.replay

        def counted() -> None:
            self.replayed += 1
            replay()

        captured.replay = counted
        return captured, out


def _block(head, gen, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A left-padded block: row i's last lengths[i] columns valid → tokens [B, M], hidden [B, M, H], valid."""
    width = max(lengths)
    valid = torch.tensor([[j >= width - n for j in range(width)] for n in lengths])
    tokens = torch.randint(0, head.config.target_vocab_size, (len(lengths), width), generator=gen)
    features = torch.randn(len(lengths), width, 3 * head.config.target_hidden_size, generator=gen)
    return tokens, head.fuse(features), valid


@torch.no_grad()
def test_the_arena_holds_what_the_growing_cache_holds(tiny_head, monkeypatch):
    head, gen, capture = copy.deepcopy(tiny_head), torch.Generator().manual_seed(0), CountingCapture()
    monkeypatch.setattr(arenas, "capture_for", lambda device: capture)
    ref, arena = open_head_cache(head, 3), StaticHeadCache(head, 3, capacity=8)

    def both_step(lengths: list[int]) -> None:
        tokens, hidden, valid = _block(head, gen, lengths)
        a, b = head.step(tokens, hidden, valid, ref), head.step(tokens, hidden, valid, arena)
        torch.testing.assert_close(a[valid], b[valid], rtol=1e-4, atol=1e-4)  # valid entries; another summing order

    def both_draft(columns: int) -> None:
        hidden = torch.randn(ref.lengths.shape[0], 1, head.config.hidden_size, generator=gen)
        for _ in range(columns):
            tokens = torch.randint(0, head.config.target_vocab_size, (ref.lengths.shape[0], 1), generator=gen)
            (a, la), (b, lb) = ref.draft_column(head, tokens, hidden), arena.draft_column(head, tokens, hidden)
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
            hidden = a
        assert torch.equal(ref.lengths, arena.lengths)

    both_step([5, 3, 1])
    both_draft(2)  # 7 columns
    kept = ref.lengths - torch.tensor([2, 0, 1])  # rejected drafted entries
    for arena_or_ref in (ref, arena):
        arena_or_ref.rollback(kept)
    both_step([2, 1, 2])
    both_draft(3)  # past 8 columns: the request moves to an arena of 16, which records its column
    assert arena.capacity == 16 and capture.recorded == 2
    for arena_or_ref in (ref, arena):
        arena_or_ref.select(torch.tensor([0, 2]))
    both_draft(2)
    both_step([1, 4])
    both_draft(1)
    assert torch.equal(ref.lengths, arena.lengths) and capture.replayed == 8


def test_the_recording_is_made_once_and_replayed_across_requests(tiny_head, monkeypatch):
    head, counting = copy.deepcopy(tiny_head), CountingCapture()  # a head no other test has given an arena
    monkeypatch.setattr(arenas, "capture_for", lambda device: counting)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        cache = open_head_cache(head, 1, "static")
        assert isinstance(cache, StaticHeadCache) and cache.lengths.tolist() == [0]  # a request starts empty
        assert type(cache.arena) is static_kv.Arena  # the backend's one arena class, of one layer
        assert len(cache.arena.keys) == 1
        with torch.no_grad():
            head.step(*_block(head, gen, [4]), cache)
            cache.draft_column(head, torch.tensor([[3]]), torch.zeros(1, 1, head.config.hidden_size))
    assert (counting.recorded, counting.replayed) == (1, 2) and len(arenas_of(head).records()) == 1
    with pytest.raises(ValueError, match="another head"):
        cache.draft_column(tiny_head, torch.tensor([[3]]), torch.zeros(1, 1, head.config.hidden_size))


@pytest.mark.parametrize(("kv_cache", "arena"), [("static", True), ("dynamic", False), ("auto", False)])
def test_kv_cache_gives_a_head_on_a_cpu_an_arena_only_when_static(tiny_head, kv_cache, arena):
    cache = open_head_cache(tiny_head, 2, kv_cache)
    assert isinstance(cache, StaticHeadCache) is arena and isinstance(cache, HeadCache) is not arena


def test_a_later_request_starts_on_the_widest_arena(tiny_head, monkeypatch):
    """A request that outgrew its arena leaves the wider one for the next request of as many rows, whose drafted
    column replays the recording already made there."""
    head, counting = copy.deepcopy(tiny_head), CountingCapture()
    monkeypatch.setattr(arenas, "capture_for", lambda device: counting)
    monkeypatch.setattr(arena_sizes, "CAPACITY_FLOOR", 8)
    gen, hidden = torch.Generator().manual_seed(2), torch.zeros(1, 1, head.config.hidden_size)
    first = open_head_cache(head, 1, "static")
    with torch.no_grad():
        head.step(*_block(head, gen, [12]), first)  # 12 entries: the request moves to an arena of 16 columns
        first.draft_column(head, torch.tensor([[3]]), hidden)
        later = open_head_cache(head, 1, "static")
        later.draft_column(head, torch.tensor([[3]]), hidden)
    assert first.capacity == later.capacity == 16 and later.arena is first.arena
    assert (counting.recorded, counting.replayed) == (1, 2)
