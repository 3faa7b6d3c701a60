"""Greedy equality with plain ``generate()`` on real models (slow: assembles and loads GGUF models).

SmolLM2-135M in float32 (shape-stable forward): speculative output must equal plain greedy exactly.
Qwen2.5-Coder 1.5B target + 0.5B draft in q4 with quantized heads (``auto``'s choice on a CPU; NF4 is
dequantized weight by weight at every forward on a CPU without AVX512-BF16, ten times slower): a 1-token
and a (k+1)-token forward (float32 activations, each row quantized to 8 bits for the kernel) may differ in the
last bits, so the output must equal plain greedy, or first diverge at a near-tie (top-2 logit gap below NEAR_TIE
at the divergence point) — never elsewhere.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hf_adaspec
from hf_adaspec.bench.bench import divergence_gap
from hf_adaspec.costs.table import CostTable

pytestmark = pytest.mark.slow
PROMPTS = [json.loads(line) for line in (Path(__file__).parent / "data" / "spec_bench_sample.jsonl").open()]
NEAR_TIE = 0.25  # logits: two bf16 ulps at |logit| in [16, 32)


def _inputs(tokenizer, text: str) -> dict:
    msgs = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)


def _assert_equal_or_near_tie(model, plain: torch.Tensor, spec: torch.Tensor) -> None:
    gap = divergence_gap(model, plain, spec)
    assert gap is None or gap < NEAR_TIE, f"output diverges from plain greedy where the top-2 gap is {gap}: a bug"


@pytest.fixture(scope="module")
def smollm():
    lm = hf_adaspec.load("smollm2-135m", quantization="none", dtype="float32")
    hf_adaspec.enable(lm.model)
    return lm


@pytest.mark.parametrize("row", PROMPTS, ids=[p["category"] for p in PROMPTS])
def test_smollm_prompt_lookup_greedy_equals_plain(smollm, row):
    model, tok = smollm.model, smollm.tokenizer
    inputs = _inputs(tok, row["turns"][0])
    plain = model.generate(**inputs, max_new_tokens=48, do_sample=False)
    for kwargs in ({"speculation": "adaptive"}, {"speculation": "fixed", "num_speculative_tokens": 4}):
        out = model.generate(**inputs, max_new_tokens=48, do_sample=False, return_dict_in_generate=True, **kwargs)
        assert torch.equal(out.sequences, plain), kwargs
        assert out.speculation.new_tokens == plain.shape[1] - inputs["input_ids"].shape[1]


def test_smollm_batch_rows_equal_batch1_plain_greedy(smollm):
    """All four prompts in one left-padded batch (prompt lookup, adaptive and fixed k): each row's new
    tokens equal that prompt's own batch-1 plain greedy output."""
    model, tok = smollm.model, smollm.tokenizer
    texts = [row["turns"][0] for row in PROMPTS]
    expected = []
    for text in texts:
        inputs = _inputs(tok, text)
        expected.append(model.generate(**inputs, max_new_tokens=32, do_sample=False)[0, inputs["input_ids"].shape[1] :])
    for kwargs in ({"speculation": "adaptive"}, {"speculation": "fixed", "num_speculative_tokens": 4}):
        out = hf_adaspec.generate_batch(model, tok, texts, max_new_tokens=32, **kwargs)
        width = out.sequences.shape[1] - max(out.stats.row_tokens)
        for i, want in enumerate(expected):
            assert out.sequences[i, width : width + want.shape[0]].tolist() == want.tolist(), (kwargs, i)
            assert out.stats.row_tokens[i] == want.shape[0]


def test_gemma3_past_its_sliding_window_adaptive_equals_plain_greedy():
    """The gemma-3-270m preset (sliding-window layers of 512 tokens beside full ones), fp32: a 600+-token prompt
    and a window's worth and 8 more new tokens with ``adaptive`` (prompt lookup and suffix drafts rolled back past
    the window) equal plain greedy token for token."""
    lm = hf_adaspec.load("gemma-3-270m", quantization="none", dtype="float32")
    model, tok = hf_adaspec.enable(lm.model), lm.tokenizer
    colours = ["red", "green", "blue", "amber", "violet"]
    log = "\n".join(f"{i}. The {colours[i % 5]} station logs {i * 7} crates at dock {i % 13}." for i in range(60))
    ids = tok(
        "Here is a shipping log:\n" + log + "\nCopy the log, then continue it with entries 60 to 140 in the "
        "same format.",
        return_tensors="pt",
    )
    assert ids["input_ids"].shape[1] >= 600 > model.config.sliding_window
    new = model.config.sliding_window + 8  # the answer alone passes the window
    kwargs = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
    plain = model.generate(**ids, **kwargs)
    out = model.generate(**ids, **kwargs, speculation="adaptive", return_dict_in_generate=True)
    assert torch.equal(out.sequences, plain)
    assert out.speculation.new_tokens == new and sum(s.accepted for s in out.speculation.steps) > 0


@pytest.fixture(scope="module")
def qwen_pair():
    """The q4 pair, named explicitly: ``auto`` would choose by this machine's timings (a test must not)."""
    target = hf_adaspec.load(hf_adaspec.DEFAULT_TARGET, quantization="q4", dtype="float32", quantize_lm_head=True)
    draft = hf_adaspec.load(hf_adaspec.DEFAULT_DRAFT, quantization="q4", dtype="float32", quantize_lm_head=True)
    hf_adaspec.enable(target.model)
    return target, draft


@pytest.mark.parametrize("row", PROMPTS[:3], ids=[p["category"] for p in PROMPTS[:3]])
def test_qwen_pair_adaptive_greedy_matches_plain(qwen_pair, row):
    target, draft = qwen_pair
    model = target.model
    inputs = _inputs(target.tokenizer, row["turns"][0])
    plain = model.generate(**inputs, max_new_tokens=40, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=40,
        do_sample=False,
        assistant_model=draft.model,
        speculation="adaptive",
        return_dict_in_generate=True,
    )
    _assert_equal_or_near_tie(model, plain, out.sequences)
    assert sum(out.speculation.k_histogram.values()) == len(out.speculation.steps)


def test_qwen_pair_sampling_runs_and_stops(qwen_pair):
    target, draft = qwen_pair
    inputs = _inputs(target.tokenizer, PROMPTS[0]["turns"][0])
    torch.manual_seed(0)
    out = target.model.generate(
        **inputs,
        max_new_tokens=24,
        do_sample=True,
        temperature=0.7,
        top_p=0.9,
        assistant_model=draft.model,
        speculation="adaptive",
        return_dict_in_generate=True,
    )
    new = out.sequences.shape[1] - inputs["input_ids"].shape[1]
    assert 1 <= new <= 24 and out.speculation.new_tokens == new


def test_qwen_pair_batch_rows_match_batch1_plain_or_near_tie(qwen_pair):
    """Three Spec-Bench prompts in one batch, the draft proposing 4 tokens a step (``fixed``: it drafts on any
    machine): each row equals its batch-1 plain greedy output or first diverges at a near-tie (batched and 1-row
    forwards differ in the last bits). A given cost table: no calibration at 2 and 3 rows."""
    target, draft = qwen_pair
    model, tok = target.model, target.tokenizer
    texts = [row["turns"][0] for row in PROMPTS[:3]]
    costs = CostTable(verify_ms=tuple(60.0 + 5.0 * n for n in range(9)), draft_ms=6.0)
    out = hf_adaspec.generate_batch(
        model,
        tok,
        texts,
        draft_model=draft.model,
        speculation="fixed",
        num_speculative_tokens=4,
        max_new_tokens=24,
        speculation_costs=costs,
    )
    assert any(s.k > 0 and s.drafter == "draft_model" for s in out.stats.steps)
    width = out.sequences.shape[1] - max(out.stats.row_tokens)
    for i, text in enumerate(texts):
        inputs = _inputs(tok, text)
        plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)
        row = out.sequences[i, width : width + out.stats.row_tokens[i]]
        _assert_equal_or_near_tie(model, plain, torch.cat([inputs["input_ids"][0], row])[None])


def test_random_weight_qwen_pair_has_the_profile_key_of_the_trained_pair():
    """A profile measured from the architectures alone (``profile --random-weights``) is the one the
    trained NF4 pair finds: same identity, same key (the committed model card's profile among them)."""
    from hf_adaspec.costs.profile_files import load_profile, profile_identity
    from hf_adaspec.models.architecture import load_architecture

    target = hf_adaspec.load(hf_adaspec.DEFAULT_TARGET, quantization="nf4")
    draft = hf_adaspec.load(hf_adaspec.DEFAULT_DRAFT, quantization="nf4", quantize_lm_head=True)
    random_target = load_architecture(hf_adaspec.DEFAULT_TARGET)
    random_draft = load_architecture(hf_adaspec.DEFAULT_DRAFT, quantize_lm_head=True)
    trained = profile_identity(target.model, draft.model)
    assert profile_identity(random_target, random_draft) == trained
    card = load_profile(Path(__file__).parent.parent / "model_cards" / "qwen2.5-coder-1.5b_0.5b" / "profile.json")
    assert {k: card.identity[k] for k in ("target", "draft")} == {k: trained[k] for k in ("target", "draft")}
