"""The family matrix: speculation on tiny random-weight models of the causal-LM families transformers ships, fp32
(shape-stable, so greedy output must equal plain greedy token for token).

- Full-attention families: a self-draft (every drafted token accepted) and a draft model of the same family
  that disagrees (rejections), batch 1.
- Families with sliding-window or chunked layers (alone, or mixed with full ones as Gemma 2/3, Cohere 2,
  GPT-OSS, OLMo 3 have), with a window of ``WINDOW`` tokens: a prompt shorter and one longer than the window,
  both generating past it, with a draft model (rejected tokens rolled back past the window), a self-draft and
  prompt lookup; a left-padded batch whose rows hold holes (windows count each row's tokens, not columns); the
  preallocated arena a GPU uses (its recordings re-run on the CPU).
- Families whose layers keep a recurrent state get one clear error naming the reason.
Every case compares with each prompt's own batch-1 plain greedy ``generate`` (transformers' sliding caches).

The fast suite runs one family of each kind (``FAST_FULL``, ``FAST_WINDOWED``), and of the windowed family one
prompt, the batch on the arena; the rest of the matrix is marked ``slow`` (``make test`` and CI run it all).
"""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import left_padded, slow_except

import hf_adaspec
from hf_adaspec import CostTable, SpeculationState
from hf_adaspec.backend import arena_sizes

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
COSTS = CostTable(verify_ms=(10.0,) * 9, draft_ms=1.0)  # cheap drafts: adaptive speculates
WINDOW = 8
NEW = 24
SHORT, LONG = [11, 12, 13, 14, 15], [5, 6, 7, 8, 9, 10, 3, 4] * 3  # 5 and 24 tokens: inside and past the window
BASE = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    initializer_range=0.5,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)
# model type → config keywords beyond BASE
FULL = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
    "gemma": {},
    "phi3": {},
    "olmo2": {},
    "granite": {},
    "stablelm": {},
    "starcoder2": {},
    "cohere": {},
    "smollm3": {"no_rope_layers": [1, 1]},
    "qwen3_moe": {},
    "mixtral": {},
    "gpt_neox": {},
    "falcon": {"head_dim": None},
    "gpt2": {},
    "opt": {},
    "bloom": {},
    "gptj": {"rotary_dim": 8},
    "phi": {},
    "olmo": {},
    "deepseek_v3": {
        "num_key_value_heads": 4,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
    },
    "glm4": {},
    "helium": {},
    "ernie4_5": {},
    "seed_oss": {},
    "apertus": {},
    "arcee": {},
}
# in the fast suite: GPT-2 (learned absolute positions, its own attention and cache code); the other full-attention
# families are slow: Llama (every other test file's tiny model) and DeepSeek-V3 (multi-head latent attention, mixture
# of experts) among them
FAST_FULL = ("gpt2",)
SLIDING = ["sliding_attention", "full_attention"]
UNTIED = {"tie_word_embeddings": False}  # Gemma's scaled tied embedding makes a tiny model repeat its last token
WINDOWED = {
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "gemma2": ("gemma2", {"sliding_window": WINDOW, "layer_types": SLIDING, **UNTIED}),
    "gemma3_text": ("gemma3_text", {"sliding_window": WINDOW, "layer_types": SLIDING, **UNTIED}),
    "cohere2": ("cohere2", {"sliding_window": WINDOW, "layer_types": SLIDING}),
    "gpt_oss": (
        "gpt_oss",
        {"sliding_window": WINDOW, "layer_types": SLIDING, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "olmo3": ("olmo3", {"sliding_window": WINDOW, "layer_types": SLIDING}),
    "exaone4": ("exaone4", {"sliding_window": WINDOW, "layer_types": SLIDING}),
    "phi3-window": ("phi3", {"sliding_window": WINDOW}),
    "starcoder2-window": ("starcoder2", {"sliding_window": WINDOW}),
    "llama4-chunked": (
        "llama4_text",
        {
            "attention_chunk_size": WINDOW,
            "layer_types": ["chunked_attention", "full_attention"],
            "intermediate_size_mlp": 64,
            "num_local_experts": 2,
            "interleave_moe_layer_step": 2,
            "no_rope_layers": [1, 0],
        },
    ),
}


# in the fast suite: Gemma 3, sliding-window layers mixed with full ones (a hybrid cache: the hardest window case,
# and a preset's family); the other windowed families (sliding-only, chunked) are slow
FAST_WINDOWED = ("gemma3_text",)


def _params(names, fast):
    """``names`` as pytest params, those outside ``fast`` marked slow."""
    return [pytest.param(n, marks=() if n in fast else pytest.mark.slow) for n in sorted(names)]


def _tiny(model_type: str, seed: int, **extra) -> torch.nn.Module:
    """A 2-layer tiny model of ``model_type`` in fp32 (weights from ``torch.manual_seed(seed)``), enabled;
    ``extra`` overrides ``BASE`` (None: leave the config's own default)."""
    given = {k: v for k, v in {**BASE, **extra}.items() if v is not None}
    config = transformers.AutoConfig.for_model(model_type, **given)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return hf_adaspec.enable(model)


def _plain(model, prompt: list[int]) -> list[int]:
    """``model``'s batch-1 plain greedy new tokens for ``prompt``."""
    return model.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt) :].tolist()


def _speculate(model, inputs: dict, draft, **kwargs):
    drafter = {} if draft is None else {"assistant_model": draft}
    return model.generate(
        **inputs,
        **drafter,
        speculation_costs=COSTS,
        speculation_state=SpeculationState(),
        max_new_tokens=NEW,
        do_sample=False,
        return_dict_in_generate=True,
        rest=False,
        **kwargs,
    )


def _check(out, prompts: list[list[int]], plain: dict, rejections: bool) -> None:
    """Each row equals its prompt's plain greedy; the run speculated (and had rejections where asked)."""
    width = out.sequences.shape[1] - NEW
    for i, prompt in enumerate(prompts):
        assert out.sequences[i, width:].tolist() == plain[tuple(prompt)], f"row {i}"
    drafted = [s for s in out.speculation.steps if s.k > 0]
    assert drafted, "no step speculated"
    if rejections:
        assert any(s.accepted < s.k for s in drafted), "no drafted token was rejected"


@pytest.mark.parametrize("family", _params(FULL, FAST_FULL))
def test_full_attention_families_equal_plain_greedy(family):
    target, other = _tiny(family, 0, **FULL[family]), _tiny(family, 1, **FULL[family])
    plain = {tuple(LONG): _plain(target, LONG)}
    inputs = {"input_ids": torch.tensor([LONG])}
    _check(_speculate(target, inputs, target, speculation="fixed", num_speculative_tokens=3), [LONG], plain, False)
    _check(_speculate(target, inputs, other, speculation="fixed", num_speculative_tokens=3), [LONG], plain, True)


@pytest.fixture(scope="module", params=_params(WINDOWED, FAST_WINDOWED))
def windowed(request):
    """(target, a draft of the same family with other weights, plain greedy by prompt) for one windowed family.
    The window matters: the same weights with a window wider than the sequence generate other tokens."""
    model_type, extra = WINDOWED[request.param]
    target, draft = _tiny(model_type, 0, **extra), _tiny(model_type, 1, **extra)
    plain = {tuple(p): _plain(target, p) for p in (SHORT, LONG)}
    wide = {
        k: 4 * (len(LONG) + NEW) if k in ("sliding_window", "attention_chunk_size") else v for k, v in extra.items()
    }
    assert _plain(_tiny(model_type, 0, **wide), LONG) != plain[tuple(LONG)], "the window changes nothing here"
    return target, draft, plain


# the fast suite keeps the prompt longer than the window; the shorter one is slow
@pytest.mark.parametrize("prompt", [pytest.param(SHORT, marks=pytest.mark.slow), LONG], ids=["shorter", "longer"])
def test_windowed_families_equal_plain_greedy_past_the_window(windowed, prompt):
    target, draft, plain = windowed
    inputs = {"input_ids": torch.tensor([prompt])}
    _check(_speculate(target, inputs, draft, speculation="fixed", num_speculative_tokens=4), [prompt], plain, True)
    _check(_speculate(target, inputs, target, speculation="fixed", num_speculative_tokens=4), [prompt], plain, False)
    _check(_speculate(target, inputs, None, speculation="adaptive"), [prompt], plain, False)


# the fast suite keeps the arena's case (static; the dynamic cache's is test_windowed_families_..._past_the_window)
@pytest.mark.parametrize("kv_cache", slow_except(["dynamic", "static"], fast={"static"}))
def test_windowed_batches_with_holes_equal_each_rows_plain_greedy(windowed, kv_cache, monkeypatch):
    """Rows of different lengths (left padding), each rejecting its own drafts: holes inside a row's window."""
    monkeypatch.setattr(arena_sizes, "CAPACITY_FLOOR", 16)  # an arena as wide as the request needs
    target, draft, plain = windowed
    out = _speculate(
        target, left_padded([LONG, SHORT]), draft, speculation="fixed", num_speculative_tokens=4, kv_cache=kv_cache
    )
    _check(out, [LONG, SHORT], plain, True)


@pytest.mark.slow  # the fast suite keeps the arena's batch case (test_windowed_batches_with_holes_...[static])
def test_windowed_single_row_on_the_arena_equals_plain_greedy(windowed, monkeypatch):
    monkeypatch.setattr(arena_sizes, "CAPACITY_FLOOR", 16)  # 16 columns: the request compacts and moves arenas
    target, draft, plain = windowed
    out = _speculate(
        target,
        {"input_ids": torch.tensor([LONG])},
        draft,
        speculation="fixed",
        num_speculative_tokens=4,
        kv_cache="static",
    )
    _check(out, [LONG], plain, True)


@pytest.mark.parametrize(
    ("model_type", "extra"),
    [
        ("mamba", {"state_size": 4, "expand": 2, "conv_kernel": 2}),
        (
            "qwen3_next",
            {
                "layer_types": ["linear_attention", "full_attention"],
                "linear_num_value_heads": 2,
                "linear_num_key_heads": 2,
                "linear_key_head_dim": 8,
                "linear_value_head_dim": 8,
                "num_experts": 2,
                "num_experts_per_tok": 1,
                "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32,
            },
        ),
        ("rwkv", {"attention_hidden_size": 32}),
    ],
)
def test_recurrent_families_get_one_clear_error(model_type, extra):
    """Layers with recurrent state (Mamba, gated DeltaNet hybrids, RWKV) cannot drop rejected tokens."""
    model = _tiny(model_type, 0, **extra)
    with pytest.raises(ValueError, match="cannot roll back rejected draft tokens.*plain generate"):
        _speculate(model, {"input_ids": torch.tensor([SHORT])}, None, speculation="adaptive")
    with pytest.raises(ValueError, match="cannot roll back"):
        _speculate(_tiny("llama", 0), {"input_ids": torch.tensor([SHORT])}, model, speculation="adaptive")
