"""Shared fixtures for the fast CPU tests: tiny random Llama models built from a config (no downloads)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import hf_adaspec


def build_tiny_llama(seed: int, vocab_size: int = 64) -> transformers.LlamaForCausalLM:
    """A 2-layer, 32-wide Llama in float32, eval mode; weights from ``torch.manual_seed(seed)``.

    initializer_range=0.5 makes the random logits peaked enough for varied, non-degenerate greedy text.
    EOS is unset so only an explicit ``eos_token_id`` stops generation.
    """
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        initializer_range=0.5, eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def build_tiny_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' 64 ids (``w0`` … ``w63``, split on whitespace), built in
    memory: no files, no downloads."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", pad_token="w0")


def left_padded(prompts, pad: int = 0) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask [B, T] for token lists of different lengths, rows right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture
def one_thread():
    """Run tiny-tensor tests on one intra-op thread (thread spin-up dominates otherwise); restore after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_factory():
    """``tiny_factory(seed, vocab_size=64)`` → a fresh tiny Llama."""
    return build_tiny_llama


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """Any calibration writes under tmp_path, never the user's cache."""
    monkeypatch.setenv("HF_ADASPEC_CACHE", str(tmp_path))


@pytest.fixture(scope="module")
def models(tiny_factory):
    """target (enabled) and drafts: another seed (α≈0), a perturbed copy (0<α<1), the target itself (α=1)."""
    target = hf_adaspec.enable(tiny_factory(0))
    noisy = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.05 * p.std() * torch.randn(p.shape, generator=gen))
    return {"target": target, "other_seed": tiny_factory(1), "noisy_copy": noisy, "same_model": tiny_factory(0)}
