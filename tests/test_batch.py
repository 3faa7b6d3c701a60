"""Static-batch speculation on tiny random Llamas: row-wise greedy equality, EOS, lossless sampling, errors.

fp32 tiny models are shape-stable, so every row's greedy output must equal that prompt's batch-1
plain greedy output token for token, whatever the padding and the holes rejected drafts leave.
"""

from __future__ import annotations


import pytest
import torch
from transformers import LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

import hf_adaspec
from hf_adaspec import BatchSpeculationStats, CostTable
from hf_adaspec.batch_controller import BatchDecision
from hf_adaspec.batch_engine import speculative_decode_batch
from hf_adaspec.engine import DecodeSettings
from hf_adaspec.generate_batch import encode_batch, generate_batch
from hf_adaspec.proposers.batch_draft_model import BatchDraftModelProposer
from hf_adaspec.proposers.batch_prompt_lookup import BatchPromptLookupProposer

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # passing costs skips calibration
PROMPTS = [[5, 6, 7, 8, 9, 10] * 4, [11, 12, 13], [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 8], [40, 41, 40, 41, 40]]
DRAFTERS = ["other_seed", "noisy_copy", "same_model", "prompt_lookup"]


def _left_padded(prompts: list[list[int]], pad: int = 0) -> dict[str, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return {"input_ids": ids, "attention_mask": mask}


def _spec(models, drafter: str, prompts=PROMPTS, **kwargs):
    draft = {} if drafter == "prompt_lookup" else {"assistant_model": models[drafter]}
    kwargs.setdefault("speculation", "adaptive")
    kwargs.setdefault("speculation_costs", COSTS)
    kwargs.setdefault("do_sample", False)
    return models["target"].generate(**_left_padded(prompts), **draft, return_dict_in_generate=True, **kwargs)


def _plain_row(models, prompt: list[int], **kwargs) -> torch.Tensor:
    """Batch-1 plain greedy new tokens for one unpadded prompt, [n]."""
    return models["target"].generate(torch.tensor([prompt]), do_sample=False, **kwargs)[0, len(prompt) :]


@pytest.mark.parametrize(("drafter", "mode"), [(d, m) for d in DRAFTERS for m in ("adaptive", "fixed", "hybrid",
                                                                                    "confidence")
                                               if not (m in ("hybrid", "confidence") and d == "prompt_lookup")])
def test_batch_rows_equal_batch1_plain_greedy(models, drafter, mode):
    k = {"num_speculative_tokens": 3} if mode == "fixed" else {}
    out = _spec(models, drafter, max_new_tokens=30, speculation=mode, **k)
    width = max(len(p) for p in PROMPTS)
    assert out.sequences.shape == (len(PROMPTS), width + 30)
    for i, prompt in enumerate(PROMPTS):
        assert torch.equal(out.sequences[i, width:], _plain_row(models, prompt, max_new_tokens=30))
    assert isinstance(out.speculation, BatchSpeculationStats)
    assert out.speculation.new_tokens == (30,) * len(PROMPTS)


def test_batch_speculates_and_accepts_ragged(models):
    stats = _spec(models, "noisy_copy", max_new_tokens=30).speculation
    assert any(s.k > 0 for s in stats.steps)
    assert any(len(set(s.accepted)) > 1 for s in stats.steps)  # rows accepted different numbers in one step
    assert 0.0 < stats.acceptance_rate < 1.0


class _AlternatingController:
    """Scripted: row i uses drafter (i + step) % 2 with k = min(3, what it offers) — both drafters every step."""

    def __init__(self) -> None:
        self.step = 0

    def choose(self, uppers, catchup, horizon=1):
        rows = len(uppers[0])
        drafters = tuple((i + self.step) % 2 for i in range(rows))
        self.step += 1
        return BatchDecision(tuple(min(3, uppers[d][i]) for i, d in enumerate(drafters)), drafters,
                             (float("nan"),) * rows, float("nan"))

    def observe(self, drafters, ks, accepted, confidences=()):
        pass

    def select(self, rows):
        pass


def test_mixed_drafters_keep_the_draft_cache_exact(models):
    """The target itself drafts (α = 1), so every draft-model token must be accepted; rows that used
    prompt lookup in a step also went through the draft's forward, and must be rolled back to exactly
    the accepted tokens or the draft would mispredict later."""
    target = models["target"]
    inputs = _left_padded(PROMPTS)
    stop = StoppingCriteriaList([MaxLengthCriteria(inputs["input_ids"].shape[1] + 40)])
    settings = DecodeSettings(LogitsProcessorList(), stop, inputs["input_ids"].shape[1] + 40, False, 3)
    proposers = [BatchDraftModelProposer(models["same_model"], len(PROMPTS), LogitsProcessorList(), False, 0),
                 BatchPromptLookupProposer()]
    result = speculative_decode_batch(target, inputs["input_ids"], inputs["attention_mask"], proposers,
                                      _AlternatingController(), settings, pad_token_id=0)
    used = [(k, n, d) for s in result.stats.steps for k, n, d in zip(s.ks, s.accepted, s.drafters)]
    assert {d for _, _, d in used} == {"draft_model", "prompt_lookup", "plain"}
    assert all(k == n for k, n, d in used if d == "draft_model")
    width = inputs["input_ids"].shape[1]
    for i, prompt in enumerate(PROMPTS):
        assert torch.equal(result.sequences[i, width:], _plain_row(models, prompt, max_new_tokens=40))


def test_rows_stop_at_eos_at_different_times(models):
    plain = [_plain_row(models, p, max_new_tokens=30) for p in PROMPTS]
    eos = int(plain[1][4])  # the 5th token of row 1: ends row 1 early (and any row that emits it sooner)
    out = _spec(models, "noisy_copy", max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    width = max(len(p) for p in PROMPTS)
    lengths = set()
    for i, prompt in enumerate(PROMPTS):
        expected = _plain_row(models, prompt, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
        row = out.sequences[i, width:]
        assert torch.equal(row[: expected.shape[0]], expected)
        assert bool((row[expected.shape[0] :] == 0).all())  # finished rows are right-padded
        assert out.speculation.new_tokens[i] == expected.shape[0]
        lengths.add(expected.shape[0])
    assert len(lengths) > 1 and min(lengths) == 5
    assert out.speculation.steps[-1].batch < len(PROMPTS)  # finished rows left the batch


def test_batch_of_one_padded_row_and_same_length_rows(models):
    same = [PROMPTS[0][:8], PROMPTS[0][6:14]]
    out = _spec(models, "noisy_copy", prompts=same, max_new_tokens=12)
    for i, prompt in enumerate(same):
        assert torch.equal(out.sequences[i, 8:], _plain_row(models, prompt, max_new_tokens=12))


def _exact_marginals(model, prompt: list[int]) -> list[torch.Tensor]:
    """Marginals [V] of the target's first three sampled tokens (temperature 1, no truncation):
    p(x1), p(x2) = Σ p(x1) p(x2 | x1), p(x3) = Σ p(x1, x2) p(x3 | x1, x2)."""
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), dim=-1)  # [V]
        vocab = p1.shape[0]
        ctx = torch.cat([torch.tensor([prompt] * vocab), torch.arange(vocab)[:, None]], dim=1)  # [V, T+1]
        p2_given = torch.softmax(model(ctx).logits[:, -1].double(), dim=-1)  # [V, V]
        joint12 = (p1[:, None] * p2_given).reshape(-1)  # [V*V] over (x1, x2)
        pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V*V, 2]
        ctx = torch.cat([torch.tensor([prompt] * vocab * vocab), pairs], dim=1)  # [V*V, T+2]
        p3_given = torch.softmax(model(ctx).logits[:, -1].double(), dim=-1)  # [V*V, V]
    return [p1, p1 @ p2_given, joint12 @ p3_given]


def _chi2_pvalue_ok(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square of counts against probs, pooling cells with expectation < 5; returns the statistic
    divided by its p = 0.001 critical value (< 1 passes; Wilson–Hilferty approximation of the quantile)."""
    n = tokens.shape[0]
    counts = torch.bincount(tokens, minlength=probs.shape[0]).double()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float((((obs - exp) ** 2)[keep] / exp[keep]).sum())
    df = int(keep.sum()) - 1
    critical = df * (1 - 2 / (9 * df) + 3.0902 * (2 / (9 * df)) ** 0.5) ** 3  # z_0.999 = 3.0902
    return stat / critical


def test_batch_sampling_is_lossless_per_row(models):
    """Each row's sampled tokens follow the target's exact distribution: rows with different prompts in
    one batch; fixed k = 2 from a perturbed draft, so the 2nd and 3rd tokens go through acceptance,
    residual resampling and the bonus token."""
    rows = 1500
    prompts = [PROMPTS[1]] * rows + [PROMPTS[2]] * rows
    torch.manual_seed(0)
    out = _spec(models, "noisy_copy", prompts=prompts, speculation="fixed", num_speculative_tokens=2,
                max_new_tokens=4, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    width = max(len(p) for p in prompts)
    first_step = out.speculation.steps[0]
    assert set(first_step.ks) == {2} and 0 < sum(first_step.accepted) < 2 * len(prompts)
    for j, prompt in enumerate([PROMPTS[1], PROMPTS[2]]):
        new = out.sequences[j * rows : (j + 1) * rows, width : width + 3]  # [rows, 3]
        for position, exact in enumerate(_exact_marginals(models["target"], prompt)):
            assert _chi2_pvalue_ok(new[:, position], exact) < 1.0, f"prompt {j}, token {position + 1}"


def test_batch_confidence_sampling_is_lossless_per_row(models):
    """speculation="confidence" under sampling: the draft loop's stop rule ends drafting on the tokens
    drafted so far (token elimination is off when sampling), and each row keeps the target's distribution."""
    rows = 1500
    prompts = [PROMPTS[1]] * rows + [PROMPTS[2]] * rows
    torch.manual_seed(0)
    out = _spec(models, "noisy_copy", prompts=prompts, speculation="confidence", max_new_tokens=4, do_sample=True,
                temperature=1.0, top_k=0, top_p=1.0)
    assert max(out.speculation.steps[0].ks) > 0 and 0 < sum(out.speculation.steps[0].accepted)
    width = max(len(p) for p in prompts)
    for j, prompt in enumerate([PROMPTS[1], PROMPTS[2]]):
        new = out.sequences[j * rows : (j + 1) * rows, width : width + 3]  # [rows, 3]
        for position, exact in enumerate(_exact_marginals(models["target"], prompt)):
            assert _chi2_pvalue_ok(new[:, position], exact) < 1.0, f"prompt {j}, token {position + 1}"


def test_negative_control_chi_square_detects_wrong_distribution(models):
    """The check above has power: the draft's own samples fail it against the target's distribution."""
    torch.manual_seed(0)
    samples = models["other_seed"].generate(torch.tensor([PROMPTS[1]] * 1500), do_sample=True, max_new_tokens=1,
                                            top_k=0)
    exact = _exact_marginals(models["target"], PROMPTS[1])[0]
    assert _chi2_pvalue_ok(samples[:, -1], exact) > 1.0


def test_right_padding_is_rejected(models):
    inputs = _left_padded(PROMPTS[:2])
    right = {"input_ids": inputs["input_ids"].flip(1), "attention_mask": inputs["attention_mask"].flip(1)}
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        models["target"].generate(**right, speculation="adaptive", speculation_costs=COSTS, max_new_tokens=4)


def test_empty_prompt_in_batch_is_rejected(models):
    inputs = _left_padded(PROMPTS[:2])
    inputs["attention_mask"][1] = 0
    with pytest.raises(ValueError, match=r"prompt\(s\) \[1\].*empty"):
        models["target"].generate(**inputs, speculation="adaptive", speculation_costs=COSTS, max_new_tokens=4)


def test_streamer_and_callback_are_rejected_for_batches(models):
    inputs = _left_padded(PROMPTS[:2])
    with pytest.raises(ValueError, match="batch size 1"):
        models["target"].generate(**inputs, speculation="adaptive", speculation_costs=COSTS, max_new_tokens=4,
                                  streamer=_NullStreamer())
    with pytest.raises(ValueError, match="batch size 1"):
        models["target"].generate(**inputs, speculation="adaptive", speculation_costs=COSTS, max_new_tokens=4,
                                  speculation_callback=lambda record, tokens: None)


class _NullStreamer(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


class CharTokenizer:
    """A minimal HF-like tokenizer: one token per character (ord % 60 + 1), pad id 0, no chat template."""

    pad_token, pad_token_id, eos_token, eos_token_id = "<pad>", 0, None, None
    chat_template = None

    def __init__(self) -> None:
        self.padding_side = "right"

    def __call__(self, texts, padding=True, return_tensors="pt", add_special_tokens=True):
        rows = [[ord(c) % 60 + 1 for c in t] for t in texts]
        enc = _left_padded(rows) if self.padding_side == "left" else None
        assert enc is not None, "generate_batch must left-pad"
        return enc

    def batch_decode(self, ids, skip_special_tokens=True):
        return ["".join(chr(96 + (t % 26)) for t in row.tolist() if t != 0) for row in ids]


def test_generate_batch_matches_plain_batched_generate(models):
    tok = CharTokenizer()
    prompts = ["abcabcabc", "hello", "xyzzy xyzzy"]
    spec = generate_batch(models["target"], tok, prompts, draft_model=models["noisy_copy"], max_new_tokens=16,
                          speculation_costs=COSTS)
    plain = generate_batch(models["target"], tok, prompts, speculation=None, max_new_tokens=16)
    assert tok.padding_side == "right"  # restored
    assert spec.texts == plain.texts and torch.equal(spec.sequences, plain.sequences)
    assert spec.stats is not None and plain.stats is None and len(spec.texts) == 3


def test_generate_batch_rejects_empty_prompts():
    with pytest.raises(ValueError, match="at least one prompt"):
        encode_batch(CharTokenizer(), [])
    with pytest.raises(ValueError, match=r"prompt\(s\) \[1\] are empty"):
        encode_batch(CharTokenizer(), ["hi", "  "])
