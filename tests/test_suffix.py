"""Suffix drafting: the depth-bounded suffix trie's counts (as arctic-inference's SuffixDecodingCache
computes them), the bounded cross-request memory, and the proposer through the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import slow_except
from transformers import LogitsProcessorList

from hf_adaspec import SpeculationState
from hf_adaspec.costs.predictors import ProfileCell
from hf_adaspec.costs.profile import assemble_profile
from hf_adaspec.costs.table import CostTable
from hf_adaspec.engine.loop import speculative_decode
from hf_adaspec.engine.settings import DecodeSettings, RunParts
from hf_adaspec.policy.controller import FixedController
from hf_adaspec.proposers.base import Rows
from hf_adaspec.proposers.suffix import SuffixMemory, SuffixProposer, best_draft, speculate
from hf_adaspec.replay.clock import Clock
from hf_adaspec.replay.replay import replay_request
from hf_adaspec.replay.trace import Trace
from hf_adaspec.replay.virtual import TraceCache, target_answers


def _a(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int64)


# (buffer, context) → (tokens, probs, match length), as arctic-inference 0.3.0's compiled tree answers
ARCTIC = [
    ((5, 1, 2, 5), (9, 5), ((1,), (1 / 2,), 1)),  # the context's own occurrence counts: 5 → 1 once in two
    ((5, 1, 2, 5, 3, 5), (9, 5), ((1,), (1 / 3,), 1)),  # a tie at count 1: the child inserted first
    ((7, 5, 1, 2, 7, 5, 1, 3, 7, 5), (2, 7, 5), ((1, 2), (2 / 3, 1 / 3), 2)),
]


@pytest.mark.parametrize(("buf", "context", "expected"), ARCTIC)
def test_counts_and_ties_as_arctic(buf, context, expected):
    draft = speculate(_a(*buf), _a(*context), 8)
    tokens, probs, match = expected
    assert draft.tokens == tokens and draft.match_len == match
    assert draft.probs == pytest.approx(probs) and draft.score == pytest.approx(sum(probs))


def test_draft_length_bounded_by_match_length_depth_and_k():
    buf, context = _a(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2), _a(9, 1, 2)  # (1 2) matches, (9 1 2) not
    assert speculate(buf, context, 8).tokens == (3, 4)  # ≤ spec_factor · match length (2)
    assert speculate(buf, context, 8, spec_offset=3.0).tokens == (3, 4, 5, 6, 7)
    assert speculate(buf, context, 1).tokens == (3,)  # ≤ k
    assert speculate(buf, context, 8, max_depth=4, spec_offset=3.0).tokens == (3, 4, 5)  # match + draft ≤ depth


def test_low_probability_tokens_are_cut():
    buf = _a(1, 2, 1, 3, 1, 4, 1, 5, 1)  # after 1: 2, 3, 4, 5 once each, and the end: 1/5 each
    assert speculate(buf, _a(9, 1), 8, min_token_prob=0.1).tokens == (2,)
    assert speculate(buf, _a(9, 1), 8, min_token_prob=0.25).tokens == ()


def test_no_match_and_separators():
    assert speculate(_a(1, 2, 3), _a(4, 5), 8).tokens == ()
    assert speculate(_a(1, 2, -1, 3), _a(9, 2), 8).tokens == ()  # nothing continues across a separator


def _every_length(
    buf: np.ndarray, context: np.ndarray, k: int, depth: int, min_prob: float
) -> tuple[tuple[int, ...], float, int]:
    """The reference search: every match length L = 1 … from the shortest, each node's children counted
    with ``np.unique`` (ties as arctic's), the best score kept, ties to the longer match."""
    context, best, n = context[-depth:], ((), 0.0, 0), buf.shape[0]
    for length in range(1, context.shape[0]):
        ends = np.array(
            [e for e in range(length - 1, n) if buf[e - length + 1 : e + 1].tolist() == context[-length:].tolist()],
            dtype=np.int64,
        )
        if not ends.size:
            break
        tokens, probs, prob = [], [], 1.0
        while len(tokens) < min(k, length, depth - length) and ends.size:
            nxt = ends[ends + 1 < n] + 1
            nxt = nxt[buf[nxt] != -1]
            if not nxt.size:
                break
            values, counts = np.unique(buf[nxt], return_counts=True)
            tied = values[counts == counts.max()]
            reached = [int(np.flatnonzero(buf[nxt] == v)[counts.max() - 1]) for v in tied]
            token = int(tied[int(np.argmin(reached) if counts.max() == 1 else np.argmax(reached))])
            prob *= counts.max() / ends.size
            if prob < min_prob:
                break
            tokens, probs, ends = tokens + [token], probs + [prob], nxt[buf[nxt] == token]
        if sum(probs) >= best[1]:
            best = (tuple(tokens), sum(probs), length)
    return best if best[0] else ((), 0.0, 0)


@pytest.mark.parametrize("seed", slow_except(range(6), fast={0}))  # make test runs every seed
def test_longest_first_search_finds_what_every_length_finds(seed):
    """Longest match first, skipping matches whose cap cannot beat the best and nodes met one token
    longer, and paths cut once they cannot win: the same draft as trying every length."""
    gen = np.random.default_rng(seed)
    for _ in range(150):
        alphabet = int(gen.integers(2, 6))  # few distinct tokens: deep matches, ties and branching nodes
        longest = 70 if gen.random() < 0.7 else 260  # long buffers: nodes above SMALL_NODE, counted by np.unique
        buf = gen.integers(1, alphabet + 1, size=int(gen.integers(1, longest)))
        buf[gen.random(buf.shape[0]) < 0.04] = -1  # separators
        context = np.concatenate([gen.integers(1, alphabet + 1, size=int(gen.integers(1, 30))), buf[-5:]])
        context = context[context != -1]
        k, depth, min_prob = int(gen.integers(1, 9)), int(gen.integers(2, 25)), float(gen.choice([0.05, 0.1, 0.3, 1.5]))
        draft = speculate(buf, context, k, max_depth=depth, min_token_prob=min_prob)
        tokens, score, length = _every_length(buf, context, k, depth, min_prob)
        assert draft.tokens == tokens and (draft.match_len if draft.tokens else 0) == length
        assert draft.score == pytest.approx(score)


def test_the_global_tree_drafts_only_where_it_scores_above_the_local_one():
    memory = SuffixMemory()
    memory.remember([1], [5, 7])  # globally 5 → 7 in one of two occurrences (score 0.5)
    row = torch.tensor([5, 9, 5, 9, 5])  # prompt 5 9 5 9, output 5: locally (5 9 5) → 9 5 (score 1.0)
    assert best_draft(memory, row, 4, 8).tokens == (9, 5)
    memory.remember([1], [9, 5, 4, 9, 5, 4])  # now (9 5) → 4 every time in the global tree (4 9: score 1.5)
    assert best_draft(memory, row, 4, 8).tokens == (4, 9)


def test_memory_is_bounded_first_in_first_out():
    memory = SuffixMemory(max_requests=2, max_tokens=100)
    for r in range(3):
        memory.remember([0], [r, r, r])
    assert [s.tolist() for s in memory.sequences] == [[1, 1, 1], [2, 2, 2]]
    assert memory.buffer().tolist() == [1, 1, 1, -1, 2, 2, 2, -1]
    memory = SuffixMemory(max_requests=10, max_tokens=5, prompts=True)
    memory.remember([7, 7], [1, 2])
    memory.remember([8], [3, 4])
    assert memory.tokens <= 5 and memory.sequences[-1].tolist() == [3, 4]


def test_proposer_drafts_an_earlier_response_from_the_rows_alone():
    memory = SuffixMemory()
    memory.remember([1, 2, 3], [10, 11, 12, 13, 14, 15])
    proposer = SuffixProposer(memory)
    # row 0 repeats the request (prompt 1 2 3); row 1 (prompt 4 5, one token of padding) matches nothing
    rows = Rows((torch.tensor([1, 2, 3, 10, 11, 12]), torch.tensor([0, 4, 5, 6])), (0, 1), prompt_width=3)
    offer = proposer.offer(rows, 8)
    assert offer.bounds == (3, 0) and offer.evidence == (3, 0) and offer.catchup == 0  # the match (10 11 12)
    assert [t.tolist() for t in offer.tokens] == [[13, 14, 15], []]
    proposals = proposer.propose(rows, offer, [2, 0])
    assert [p.tokens[0].tolist() for p in proposals] == [[13, 14], []] and proposals[0].q is None
    proposer.commit(torch.tensor([6, 3]), keep=torch.tensor([1]))  # nothing kept between calls
    assert [t.tolist() for t in proposer.offer(rows, 8).tokens] == [[13, 14, 15], []]


def test_repeated_request_through_the_engine_is_exact_and_drafts_from_memory():
    sequence = torch.tensor([1, 2, 3, 4, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21])
    prompt = 4

    def run(memory: SuffixMemory):
        target = TraceCache([target_answers(sequence, 0)], 32)
        proposer = SuffixProposer(memory, spec_offset=8.0)
        settings = DecodeSettings(LogitsProcessorList(), lambda ids, s: torch.tensor([ids.shape[1] >= 16]), 16, False)
        parts = RunParts(target, (proposer,), FixedController(8, paid=False), settings, 8)
        return speculative_decode(parts, sequence[None, :prompt], torch.ones(1, prompt, dtype=torch.long))

    memory = SuffixMemory()
    first = run(memory)
    assert first.sequences[0].tolist() == sequence.tolist()
    assert sum(s.accepted for s in first.stats.steps) == 0  # nothing repeats within the request
    memory.remember(sequence[:prompt].tolist(), sequence[prompt:].tolist())
    again = run(memory)
    assert again.sequences[0].tolist() == sequence.tolist()
    assert sum(s.accepted for s in again.stats.steps) > 0 and len(again.stats.steps) < len(first.stats.steps)


# the fast suite keeps test_repeated_request_through_the_engine_is_exact_and_drafts_from_memory and
# test_replay_carries_the_memory_across_requests
@pytest.mark.slow  # three requests on a tiny Llama
def test_generate_remembers_responses_and_drafts_them_again(models, one_thread):
    table = CostTable((10.0, 10.5, 11.0, 11.5, 12.0, 12.5, 13.0, 13.5, 14.0), 2.0, draft_catchup_ms=0.5)
    prompt = torch.tensor([[3, 17, 29, 41, 5, 8, 13, 21]])
    target, state = models["target"], SpeculationState()
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)

    def spec():
        return target.generate(
            prompt,
            max_new_tokens=24,
            do_sample=False,
            speculation="adaptive",
            speculation_costs=table,
            speculation_state=state,
            return_dict_in_generate=True,
        )

    first = spec()
    assert torch.equal(first.sequences, plain)
    assert [s.tolist() for s in state.suffixes.sequences] == [plain[0, prompt.shape[1] :].tolist()]
    again = spec()  # the same request: its answer is in memory
    assert torch.equal(again.sequences, plain)
    used = [s for s in again.speculation.steps if s.drafter == "suffix"]
    assert used and sum(s.accepted for s in used) > 0
    assert len(again.speculation.steps) < len(first.speculation.steps)


def test_replay_carries_the_memory_across_requests():
    tokens = (1, 2, 3, 4, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42)
    trace = Trace(7, "c", 4, tokens, (), (), (99,), 10.0, 13, "t", "")
    cells = {
        "target": [ProfileCell(1, c, n, 10.0 + 0.5 * (n - 1)) for c in (16, 64) for n in (1, 4, 9)],
        "draft": [ProfileCell(1, c, n, 2.0 if n == 1 else 16.0) for c in (16, 64) for n in (1, 32)],
        "held_out_target": [ProfileCell(1, 40, 2, 10.5)],
        "held_out_draft": [ProfileCell(1, 40, 1, 2.0)],
    }
    state, clock = SpeculationState(), Clock(assemble_profile("tiny", {"target": "tiny"}, cells, {}))
    first = replay_request([trace], "adaptive-lookup", state, clock)
    assert first.matches_trace and [s.tolist() for s in state.suffixes.sequences] == [list(tokens[4:])]
    again = replay_request([trace], "adaptive-lookup", state, clock)
    assert again.matches_trace and again.drafter_histogram.get("suffix", 0) > 0 and again.steps < first.steps
