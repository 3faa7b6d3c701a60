"""The invariants every speculation setting keeps, on the tiny random Llamas of conftest (fp32, no downloads).

1. Greedy output is plain greedy ``generate``'s, token for token: one matrix over every mode ("adaptive";
   "fixed" with k = 3; "fixed" with k = 8 and draft_p_min = 0.75) × every kind of drafter (a draft model that
   agrees in part, one that almost never agrees, an EAGLE-3 draft head, none: prompt lookup) × batch size 1
   and 3 (left-padded rows
   of different lengths, each compared with its own batch-1 plain output). fp32 tiny models are shape-stable,
   so equality is exact even though speculation runs forwards of other widths and holes in the cache.
2. Sampling is lossless: tokens emitted by speculative sampling follow the target's distribution, checked by
   a chi-square test at p = 0.001 — on the verification functions directly and through ``generate`` — with
   negative controls: deliberately biased samplers that the same test must reject.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import transformers
from conftest import left_padded, single_thread, slow_except

import hf_adaspec
import hf_adaspec.engine.step_verify as step_verify
import hf_adaspec.engine.verification as verification
from hf_adaspec import CostTable, SpeculationState
from hf_adaspec.backend import arena_sizes
from hf_adaspec.engine.verification import Verification, speculative_sample
from hf_adaspec.gpu_check.sampling import chi2_ratio  # the same test the GPU check runs on the device

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # passing costs skips calibration
# rows of different lengths, none holding the pad id 0 (plain generate would take a 0 for padding)
PROMPTS = ([5, 6, 7, 8, 9, 10] * 4, [11, 12, 13], [3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 8])
NEW = 24

MODES = {
    "adaptive": {"speculation": "adaptive"},
    "fixed-k3": {"speculation": "fixed", "num_speculative_tokens": 3},
    "fixed-k8-pmin": {"speculation": "fixed", "num_speculative_tokens": 8, "draft_p_min": 0.75},
}
K_CAP = {"adaptive": 8, "fixed-k3": 3, "fixed-k8-pmin": 8}
DRAFTERS = ("noisy_copy", "other_seed", "draft_head", "prompt_lookup")  # 0 < α < 1, α ≈ 0, a head, no draft model


@pytest.fixture(scope="module")
def assistants(models, tiny_head):
    """The draft models by name, and the tiny trained EAGLE-3 head as "draft_head"."""
    return {**models, "draft_head": tiny_head}


@pytest.fixture(scope="module")
def plain_greedy(models):
    """plain_greedy(prompt) → the target's batch-1 plain greedy new tokens (a list), computed once per prompt."""
    done: dict[tuple[int, ...], list[int]] = {}

    def get(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in done:
            out = models["target"].generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)
            done[key] = out[0, len(prompt) :].tolist()
        return done[key]

    return get


# --- 1. greedy output equals plain generate -----------------------------------------------------------

# the fast suite runs 3 of the 48 cases, one per engine path and kind of drafter: a draft model on the dynamic cache
# (fixed k = 3, a left-padded batch), the EAGLE-3 head on the static arena (adaptive, a left-padded batch) and prompt
# lookup (fixed k = 3, batch 1, dynamic); the other 45 are marked slow (make test and CI run all 48)
FAST_GREEDY = {"fixed-k3-noisy_copy-3-dynamic", "adaptive-draft_head-3-static", "fixed-k3-prompt_lookup-1-dynamic"}


def _greedy_cases():
    for mode in MODES:
        for drafter in DRAFTERS:
            for batch in (1, 3):
                for kv_cache in ("dynamic", "static"):
                    case = f"{mode}-{drafter}-{batch}-{kv_cache}"
                    yield pytest.param(
                        mode,
                        drafter,
                        batch,
                        kv_cache,
                        marks=() if case in FAST_GREEDY else pytest.mark.slow,
                        id=case,
                    )


@pytest.mark.parametrize(("mode", "drafter", "batch", "kv_cache"), list(_greedy_cases()))
def test_greedy_output_equals_plain_generate(models, assistants, plain_greedy, mode, drafter, batch, kv_cache):
    """(``kv_cache="static"``: the preallocated arena, its recordings re-run on the CPU, ``graphs.Rerun``.)"""
    prompts = PROMPTS[:batch]
    inputs = left_padded(prompts) if batch > 1 else {"input_ids": torch.tensor([prompts[0]])}
    draft = {} if drafter == "prompt_lookup" else {"assistant_model": assistants[drafter]}
    # rest=False: resting reads measured decision times, so a loaded machine could rest through every step
    out = models["target"].generate(
        **inputs,
        **draft,
        **MODES[mode],
        speculation_costs=COSTS,
        speculation_state=SpeculationState(),
        max_new_tokens=NEW,
        do_sample=False,
        return_dict_in_generate=True,
        kv_cache=kv_cache,
        rest=False,
    )
    width = inputs["input_ids"].shape[1]
    assert out.sequences.shape == (batch, width + NEW)
    assert torch.equal(out.sequences[:, :width], inputs["input_ids"])
    for i, prompt in enumerate(prompts):
        assert out.sequences[i, width:].tolist() == plain_greedy(prompt), f"row {i}"

    # the bookkeeping agrees with the output, row by row
    stats = out.speculation
    assert stats.batch == batch and stats.row_tokens == (NEW,) * batch
    for i in range(batch):
        steps = stats.row(i).steps
        assert sum(s.emitted for s in steps) == NEW - 1  # the prefill emits each row's first token
        assert all(0 <= s.accepted <= s.k and 1 <= s.emitted <= s.accepted + 1 for s in steps)
        assert [s.step for s in steps] == list(range(len(steps)))  # one record per step the row was in
    # it speculated (an all-plain run would make the equality trivial), within the mode's cap, with its drafters
    assert any(s.k > 0 for s in stats.steps)
    assert max(stats.k_histogram) <= K_CAP[mode]
    paid = "draft_head" if drafter == "draft_head" else "draft_model"
    allowed = {"plain", "prompt_lookup"} if drafter == "prompt_lookup" else {"plain", paid}
    if mode == "adaptive":
        allowed |= {"prompt_lookup", "suffix"}  # adaptive lets the costless drafters compete with the draft model
    assert {s.drafter for s in stats.steps} <= allowed and {s.drafter for s in stats.steps} - {"plain"}


# --- 2. lossless sampling -------------------------------------------------------------------------------


def test_chi2_ratio_accepts_exact_samples_and_rejects_a_shifted_distribution():
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(20, generator=gen, dtype=torch.float64), dim=-1)
    samples = torch.multinomial(p, 20_000, replacement=True, generator=gen)
    assert chi2_ratio(samples, p) < 1.0
    shifted = 0.9 * p + 0.1 * torch.full_like(p, 1 / 20)  # 10% of the mass moved to uniform
    assert chi2_ratio(samples, shifted) > 1.0


# ... on the verification functions: p, q of V tokens, many rows at once

V = 6
ROWS = 100_000


def _problem(k: int, seed: int, one_hot: bool = False):
    """p [k+1, V], q [k, V] (peaked differently so q ≠ p matters) and draft tokens [ROWS, k] sampled from q."""
    gen = torch.Generator().manual_seed(seed)
    p = torch.softmax(1.5 * torch.randn(k + 1, V, generator=gen), dim=-1)
    q = torch.softmax(1.5 * torch.randn(k, V, generator=gen), dim=-1)
    if one_hot:  # deterministic drafter (prompt lookup): always proposes token i % V at position i
        q = torch.nn.functional.one_hot(torch.arange(k) % V, V).float()
    draft = torch.stack([torch.multinomial(q[i].expand(ROWS, V), 1, generator=gen)[:, 0] for i in range(k)], 1)
    return p, q, draft, gen


def _emitted(draft: torch.Tensor, result: Verification, position: int) -> torch.Tensor:
    """Token emitted at ``position`` (0 or 1) per row: the accepted draft token, else the correction/bonus."""
    n = result.num_accepted
    return torch.where(n > position, draft[:, min(position, draft.shape[1] - 1)], result.next_token)


def _sample(draft, q, p, gen) -> Verification:
    k = draft.shape[1]
    return speculative_sample(draft, q.expand(ROWS, k, V), p.expand(ROWS, k + 1, V), generator=gen)


# fast: k = 1 from a peaked q; k = 3 and the one-hot q (a deterministic drafter) are slow
@pytest.mark.parametrize("k", slow_except([1, 3], fast={1}))
@pytest.mark.parametrize("one_hot", slow_except([False, True], fast={False}))
def test_speculative_sample_first_token_follows_p(k, one_hot):
    p, q, draft, gen = _problem(k, seed=10 + k, one_hot=one_hot)
    result = _sample(draft, q, p, gen)
    assert result.num_accepted.shape == (ROWS,) and int(result.num_accepted.max()) <= k
    assert 0 < float((result.num_accepted > 0).double().mean()) < 1  # both branches exercised
    assert chi2_ratio(_emitted(draft, result, 0), p[0]) < 1.0


@pytest.mark.slow  # the fast suite keeps test_generate_sampling_is_lossless_per_row (its 2nd and 3rd tokens)
def test_speculative_sample_second_token_follows_p_given_first_accepted():
    p, q, draft, gen = _problem(3, seed=7)
    result = _sample(draft, q, p, gen)
    kept = result.num_accepted >= 1  # the second emitted token is made in this step
    second = _emitted(draft, result, 1)[kept]
    assert second.numel() > ROWS // 10
    assert chi2_ratio(second, p[1]) < 1.0


@pytest.mark.slow  # the fast suite keeps test_generate_sampling_is_lossless_per_row (its bonus tokens)
def test_speculative_sample_all_accepted_bonus_follows_last_p():
    k = 2
    p, _, _, gen = _problem(k, seed=3)
    draft = torch.zeros(ROWS, k, dtype=torch.long)
    q = torch.nn.functional.one_hot(draft[0], V).float()  # [k, V]
    p_accept = p.clone()
    p_accept[:k] = q  # p = q on the drafted positions → always accepted
    result = _sample(draft, q, p_accept, gen)
    assert bool((result.num_accepted == k).all())
    assert chi2_ratio(result.next_token, p[k]) < 1.0


def test_negative_control_unchecked_draft_tokens_are_rejected():
    p, _, draft, _ = _problem(1, seed=11)
    assert chi2_ratio(draft[:, 0], p[0]) > 10.0  # emitting the draft's tokens unverified is detected


def test_negative_control_wrong_residual_is_rejected(monkeypatch):
    # a subtle bug: resample from p (not norm(max(0, p − q))) after a rejection → biased towards q
    monkeypatch.setattr(verification, "residual_distribution", lambda p, q: p)
    p, q, draft, gen = _problem(1, seed=11)
    assert chi2_ratio(_emitted(draft, _sample(draft, q, p, gen), 0), p[0]) > 10.0


# ... through generate: many copies of two prompts in one batch; the second holds 40 distinct tokens, so prompt
# lookup finds a continuation of many first tokens

SAMPLED_PROMPTS = (PROMPTS[1], list(range(1, 41)))
COPIES = 1000


def _marginals(model) -> list[list[torch.Tensor]]:
    """Per prompt of SAMPLED_PROMPTS, ``model``'s exact marginals [V] of its first three sampled tokens
    (temperature 1, no truncation): p(x1), p(x2) = Σ p(x1) p(x2 | x1), p(x3) = Σ p(x1, x2) p(x3 | x1, x2)."""
    out = []
    with single_thread(), torch.no_grad():  # module fixtures run before the one_thread fixture
        for prompt in SAMPLED_PROMPTS:
            p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), dim=-1)  # [V]
            vocab = p1.shape[0]
            ctx = torch.cat([torch.tensor([prompt] * vocab), torch.arange(vocab)[:, None]], dim=1)  # [V, T+1]
            p2_given = torch.softmax(model(ctx).logits[:, -1].double(), dim=-1)  # [V, V]
            joint12 = (p1[:, None] * p2_given).reshape(-1)  # [V*V] over (x1, x2)
            pairs = torch.cartesian_prod(torch.arange(vocab), torch.arange(vocab))  # [V*V, 2]
            cache = model(torch.tensor([prompt]), use_cache=True).past_key_values  # the prompt, once
            cache.batch_repeat_interleave(vocab * vocab)
            logits = model(pairs, past_key_values=cache, logits_to_keep=1).logits[:, -1]  # [V*V, V]
            p3_given = torch.softmax(logits.double(), dim=-1)
            out.append([p1, p1 @ p2_given, joint12 @ p3_given])
    return out


@pytest.fixture(scope="module")
def exact_marginals(models):
    """``_marginals`` of the tiny target."""
    return _marginals(models["target"])


def _sampled(models, drafter: str = "noisy_copy", costs: CostTable = COSTS, **kwargs):
    """Sample 4 tokens for COPIES copies of each prompt in one left-padded batch → (new tokens [2·COPIES, 4],
    stats). ``models``: the assistants by name."""
    prompts = [SAMPLED_PROMPTS[0]] * COPIES + [SAMPLED_PROMPTS[1]] * COPIES
    inputs = left_padded(prompts)
    draft = {} if drafter == "prompt_lookup" else {"assistant_model": models[drafter]}
    torch.manual_seed(0)
    out = models["target"].generate(
        **inputs,
        **draft,
        speculation_costs=costs,
        speculation_state=SpeculationState(),
        max_new_tokens=4,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        return_dict_in_generate=True,
        **kwargs,
    )
    return out.sequences[:, inputs["input_ids"].shape[1] :], out.speculation


def _ratios(new: torch.Tensor, marginals) -> list[list[float]]:
    """chi2_ratio per prompt per position 1..3 (position 1 is the prefill's sample, 2 and 3 speculative)."""
    return [
        [chi2_ratio(new[j * COPIES : (j + 1) * COPIES, pos], marginals[j][pos]) for pos in range(3)]
        for j in range(len(SAMPLED_PROMPTS))
    ]


# verification cost grows with width: adaptive's confidence stop rule ends the draft model's proposal early
STEEP = CostTable(verify_ms=tuple(10.0 + 4.0 * n for n in range(9)), draft_ms=2.0)


SLOW = pytest.mark.slow  # ~2 s per case: the fast suite keeps the first; make test and CI run them all


@pytest.mark.parametrize(
    ("mode", "drafter", "kv_cache"),
    [
        ("fixed-k2", "noisy_copy", "dynamic"),
        pytest.param("fixed-k2", "prompt_lookup", "dynamic", marks=SLOW),
        pytest.param("fixed-k2", "draft_head", "dynamic", marks=SLOW),
        pytest.param("adaptive-stopped", "noisy_copy", "dynamic", marks=SLOW),
        pytest.param("fixed-k2", "noisy_copy", "static", marks=SLOW),
        pytest.param("adaptive-stopped", "noisy_copy", "static", marks=SLOW),
        pytest.param("fixed-k2", "draft_head", "static", marks=SLOW),
    ],
)
def test_generate_sampling_is_lossless_per_row(assistants, exact_marginals, mode, drafter, kv_cache, monkeypatch):
    """Each row's sampled tokens follow the target's exact distribution: the 2nd and 3rd tokens go through
    acceptance, residual resampling and the bonus token ("fixed": k = 2 from the perturbed copy, or from prompt
    lookup, a deterministic drafter: q one-hot; or from the tiny EAGLE-3 head, whose q is zero off its draft
    vocabulary; "adaptive" under steep costs: the draft model offered 2 tokens and stopped by its confidence
    stop rule after 1). The arenas get the columns the request needs (64), not the 256-column floor: attention
    reads every column, and 2,048 rows × 256 would spend the test on empty ones (the head's arena too)."""
    monkeypatch.setattr(arena_sizes, "CAPACITY_FLOOR", 16)
    if mode == "fixed-k2":
        new, stats = _sampled(assistants, drafter, speculation="fixed", num_speculative_tokens=2, kv_cache=kv_cache)
    else:
        new, stats = _sampled(
            assistants, drafter, costs=STEEP, speculation="adaptive", kv_cache=kv_cache, max_slowdown=math.inf
        )  # the stop rule from the first step: no slack to earn first
    first = [s for s in stats.steps if s.step == 0]
    assert len(first) == 2 * COPIES
    drafted = [s for s in first if s.k > 0]
    assert len(drafted) > COPIES // 4  # many rows speculated their 2nd token
    assert 0 < sum(s.accepted for s in drafted) < sum(s.k for s in drafted)  # acceptance and rejection both happen
    if mode == "adaptive-stopped":
        assert {(s.drafter, s.k) for s in first} == {("draft_model", 1)}
    for j, row in enumerate(_ratios(new, exact_marginals)):
        assert max(row) < 1.0, f"prompt {j}: {row}"


def test_negative_control_generate_with_a_biased_sampler_is_rejected(models, exact_marginals, monkeypatch):
    """The check above has power: a verifier that accepts every draft token unchecked (so the 2nd token
    comes from the draft's distribution) fails it at the first speculative token of both prompts."""

    def accept_all(draft_tokens, q, p, generator=None):
        bonus = torch.multinomial(p[:, -1], 1, generator=generator)[:, 0]
        return Verification(torch.full((draft_tokens.shape[0],), draft_tokens.shape[1]), bonus)

    monkeypatch.setattr(step_verify, "speculative_sample", accept_all)
    new, stats = _sampled(models, speculation="fixed", num_speculative_tokens=2)
    assert all(s.accepted == s.k == 2 for s in stats.steps if s.step == 0)  # the biased sampler did run
    ratios = _ratios(new, exact_marginals)
    assert all(row[1] > 1.0 for row in ratios), ratios


@pytest.fixture(scope="module")
def windowed_models():
    """A tiny Qwen2 whose second layer slides over a window of 4 tokens (a hybrid cache: full and sliding
    layers; both prompts and their samples pass the window), enabled, and a perturbed copy as its draft."""
    config = transformers.Qwen2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.5,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    with single_thread():
        target = hf_adaspec.enable(transformers.Qwen2ForCausalLM(config).float().eval())
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = None, 0
    noisy = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    return {"target": target, "noisy_copy": noisy}


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache", ["dynamic", "static"])
def test_sampling_with_sliding_window_layers_is_lossless(windowed_models, kv_cache, monkeypatch):
    """The chi-square check on a hybrid model (full and sliding-window layers), the batch left-padded: windows
    are counted in each row's tokens across its holes, in the dynamic cache and in the arena."""
    assert windowed_models["target"].config.layer_types == ["full_attention", "sliding_attention"]
    monkeypatch.setattr(arena_sizes, "CAPACITY_FLOOR", 16)
    new, stats = _sampled(windowed_models, speculation="fixed", num_speculative_tokens=2, kv_cache=kv_cache)
    drafted = [s for s in stats.steps if s.step == 0 and s.k > 0]
    assert 0 < sum(s.accepted for s in drafted) < sum(s.k for s in drafted)
    for j, row in enumerate(_ratios(new, _marginals(windowed_models["target"]))):
        assert max(row) < 1.0, f"prompt {j}: {row}"
