"""Static-batch speculation on tiny random Llamas: ragged acceptance, mixed drafters in one step, rows that
stop at different times, ``generate_batch``.

fp32 tiny models are shape-stable, so every row's greedy output must equal that prompt's batch-1 plain
greedy output token for token, whatever the padding and the holes rejected drafts leave (the mode ×
drafter matrix of that invariant is in test_invariants.py; lossless batch sampling too).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
from conftest import left_padded, slow_except
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

from hf_adaspec import CostTable, SpeculationState, SpeculationStats
from hf_adaspec.api.generate_batch import encode_batch, generate_batch
from hf_adaspec.backend.ragged import RaggedCache
from hf_adaspec.engine.loop import speculative_decode
from hf_adaspec.engine.settings import DecodeSettings, RunParts
from hf_adaspec.policy.controller import StepView
from hf_adaspec.policy.decision import Decision
from hf_adaspec.proposers import DraftModelProposer, PromptLookupProposer

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # passing costs skips calibration
PROMPTS = [[5, 6, 7, 8, 9, 10] * 4, [11, 12, 13], [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 8], [40, 41, 40, 41, 40]]


def _spec(models, drafter: str, prompts=PROMPTS, **kwargs):
    draft = {} if drafter == "prompt_lookup" else {"assistant_model": models[drafter]}
    kwargs.setdefault("speculation", "adaptive")
    kwargs.setdefault("speculation_costs", COSTS)
    kwargs.setdefault("speculation_state", SpeculationState())
    kwargs.setdefault("do_sample", False)
    return models["target"].generate(**left_padded(prompts), **draft, return_dict_in_generate=True, **kwargs)


def _plain_row(models, prompt: list[int], **kwargs) -> torch.Tensor:
    """Batch-1 plain greedy new tokens for one unpadded prompt (no pad id 0 in it), [n]."""
    return models["target"].generate(torch.tensor([prompt]), do_sample=False, **kwargs)[0, len(prompt) :]


def _by_step(stats: SpeculationStats) -> dict[int, list]:
    steps = defaultdict(list)
    for record in stats.steps:
        steps[record.step].append(record)
    return steps


# adaptive without the slowdown bound: it speculates from the first step, whatever the engine's timing; the fast
# suite keeps fixed's case (mode1), adaptive's is slow
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param({"speculation": "adaptive", "max_slowdown": math.inf}, marks=pytest.mark.slow),
        {"speculation": "fixed", "num_speculative_tokens": 3},
    ],
)
def test_batch_speculates_and_accepts_ragged(models, mode):
    out = _spec(models, "noisy_copy", max_new_tokens=30, **mode)
    width = max(len(p) for p in PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        assert torch.equal(out.sequences[i, width:], _plain_row(models, prompt, max_new_tokens=30))
    stats = out.speculation
    assert stats.row_tokens == (30,) * len(PROMPTS)
    steps = _by_step(stats)
    assert sorted(r.row for r in steps[0]) == list(range(len(PROMPTS)))  # one record per active row per step
    assert all(len({r.row for r in records}) == len(records) for records in steps.values())
    assert any(len({r.accepted for r in records}) > 1 for records in steps.values())  # rows accepted differently
    assert 0.0 < stats.acceptance_rate < 1.0


class _AlternatingController:
    """Scripted: row i uses drafter (i + step) % 2 with k = min(3, what it offers) — both drafters every step."""

    def __init__(self) -> None:
        self.step = 0

    def decide(self, batch: int, view: Callable[[], StepView]) -> Decision:
        drafters = tuple((i + self.step) % 2 for i in range(batch))
        self.step += 1
        bounds = view().bounds
        return Decision(
            tuple(min(3, bounds[d][i]) for i, d in enumerate(drafters)), drafters, (math.nan,) * batch, math.nan
        )

    def observe(self, decision, outcome):
        pass

    def account(self, elapsed_ms, emitted, plain, predicted_ms):
        pass

    def may_explore(self):
        return True

    def select(self, rows):
        pass


def test_mixed_drafters_keep_the_draft_cache_exact(models):
    """The target itself drafts (α = 1), so every draft-model token must be accepted; rows that used
    prompt lookup in a step also went through the draft's forward, and must be rolled back to exactly
    the accepted tokens or the draft would mispredict later."""
    target = models["target"]
    inputs = left_padded(PROMPTS)
    width = inputs["input_ids"].shape[1]
    stop = StoppingCriteriaList([MaxLengthCriteria(width + 40)])
    settings = DecodeSettings(LogitsProcessorList(), stop, width + 40, False)
    drafters = (
        DraftModelProposer(RaggedCache(models["same_model"], len(PROMPTS)), LogitsProcessorList(), False, 0),
        PromptLookupProposer(),
    )
    parts = RunParts(RaggedCache(target, len(PROMPTS)), drafters, _AlternatingController(), settings, 3)
    result = speculative_decode(parts, inputs["input_ids"], inputs["attention_mask"])
    used = [(s.k, s.accepted, s.drafter) for s in result.stats.steps]
    assert {d for _, _, d in used} == {"draft_model", "prompt_lookup", "plain"}
    assert all(k == n for k, n, d in used if d == "draft_model")
    for i, prompt in enumerate(PROMPTS):
        assert torch.equal(result.sequences[i, width:], _plain_row(models, prompt, max_new_tokens=40))


# the fast suite keeps prompt lookup's case; the draft model's is slow
@pytest.mark.parametrize("drafter", slow_except(["noisy_copy", "prompt_lookup"], fast={"prompt_lookup"}))
def test_rows_stop_at_eos_at_different_times(models, drafter):
    plain = [_plain_row(models, p, max_new_tokens=30) for p in PROMPTS]
    eos = int(plain[1][4])  # the 5th token of row 1: ends row 1 early (and any row that emits it sooner)
    out = _spec(models, drafter, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    width = max(len(p) for p in PROMPTS)
    lengths = set()
    for i, prompt in enumerate(PROMPTS):
        expected = _plain_row(models, prompt, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
        row = out.sequences[i, width:]
        assert torch.equal(row[: expected.shape[0]], expected)
        assert bool((row[expected.shape[0] :] == 0).all())  # finished rows are right-padded
        assert out.speculation.row_tokens[i] == expected.shape[0]
        lengths.add(expected.shape[0])
    assert len(lengths) > 1 and min(lengths) == 5
    steps = _by_step(out.speculation)
    assert len(steps[max(steps)]) < len(PROMPTS)  # finished rows left the batch
    assert out.speculation.row(1).steps[-1].step < max(steps)  # row 1 stopped before the others


def test_same_length_rows_and_a_single_padded_row(models):
    same = [PROMPTS[0][:8], PROMPTS[0][6:14]]
    out = _spec(models, "noisy_copy", prompts=same, max_new_tokens=12)
    for i, prompt in enumerate(same):
        assert torch.equal(out.sequences[i, 8:], _plain_row(models, prompt, max_new_tokens=12))
    padded = left_padded([PROMPTS[1]], pad=0)  # one row, two holes: width 3 → pad to 5
    ids = torch.cat([torch.zeros(1, 2, dtype=torch.long), padded["input_ids"]], dim=1)
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), padded["attention_mask"]], dim=1)
    one = models["target"].generate(
        ids,
        attention_mask=mask,
        assistant_model=models["noisy_copy"],
        speculation="adaptive",
        speculation_costs=COSTS,
        max_new_tokens=12,
        do_sample=False,
    )
    assert torch.equal(one[0, 5:], _plain_row(models, PROMPTS[1], max_new_tokens=12))


class CharTokenizer:
    """A minimal HF-like tokenizer: one token per character (ord % 60 + 1), pad id 0, no chat template."""

    pad_token, pad_token_id, eos_token, eos_token_id = "<pad>", 0, None, None
    chat_template = None

    def __init__(self) -> None:
        self.padding_side = "right"

    def __call__(self, texts, padding=True, return_tensors="pt", add_special_tokens=True):
        rows = [[ord(c) % 60 + 1 for c in t] for t in texts]
        enc = left_padded(rows) if self.padding_side == "left" else None
        assert enc is not None, "generate_batch must left-pad"
        return enc

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(96 + (t % 26)) for t in row.tolist() if t != 0) for row in ids]


# the fast suite keeps the draft model's case (generate_batch passes it on); None's is slow
@pytest.mark.parametrize("draft", slow_except(["noisy_copy", None], fast={"noisy_copy"}))
def test_generate_batch_matches_plain_batched_generate(models, draft):
    tok = CharTokenizer()
    prompts = ["abcabcabc", "hello", "xyzzy xyzzy"]
    spec = generate_batch(
        models["target"],
        tok,
        prompts,
        draft_model=models[draft] if draft else None,
        max_new_tokens=16,
        speculation_costs=COSTS,
        speculation_state=SpeculationState(),
        max_slowdown=math.inf,
    )  # speculates from the first step: batch mechanics, not policy
    plain = generate_batch(models["target"], tok, prompts, speculation=None, max_new_tokens=16)
    assert tok.padding_side == "right"  # restored
    assert spec.texts == plain.texts and torch.equal(spec.sequences, plain.sequences)
    assert isinstance(spec.stats, SpeculationStats) and spec.stats.batch == 3 and plain.stats is None
    assert spec.stats.row_tokens == (16,) * 3 and any(s.k > 0 for s in spec.stats.steps)
    drafters = {s.drafter for s in spec.stats.steps}
    assert drafters <= {"plain", "prompt_lookup", "draft_model"} and ("draft_model" in drafters) == bool(draft)


def test_generate_batch_fixed_needs_k_and_rejects_empty_prompts(models):
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        generate_batch(models["target"], CharTokenizer(), ["hi"], speculation="fixed", speculation_costs=COSTS)
    with pytest.raises(ValueError, match="at least one prompt"):
        encode_batch(CharTokenizer(), [])
    with pytest.raises(ValueError, match=r"prompt\(s\) \[1\] are empty"):
        encode_batch(CharTokenizer(), ["hi", "  "])
