"""``generate_batch``: speculative generation for a list of prompts in one static batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import _check_integer
from ..engine.stats import SpeculationStats
from .generate import enable


@dataclass(frozen=True)
class BatchGeneration:
    """texts: the new text per prompt; sequences: [B, T + new] long (left-padded prompts, finished rows
    right-padded); stats: the batch's decisions (None for plain decoding)."""

    texts: tuple[str, ...]
    sequences: torch.Tensor
    stats: SpeculationStats | None


def encode_batch(tokenizer, prompts: Sequence[str], chat: bool = True) -> dict[str, torch.Tensor]:
    """Left-padded ``input_ids`` and ``attention_mask`` [B, T] for the prompts (chat template applied
    when ``chat`` and the tokenizer has one).

    Raises:
        ValueError: no prompts, or an empty prompt.
    """
    if not prompts:
        raise ValueError("generate_batch needs at least one prompt")
    empty = [i for i, p in enumerate(prompts) if not p.strip()]
    if empty:
        raise ValueError(f"prompt(s) {empty} are empty; every prompt needs text")
    texts = list(prompts)
    if chat and getattr(tokenizer, "chat_template", None):
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts
        ]
    side, pad = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if pad is None:  # many causal LM tokenizers have none; pad with EOS, as transformers' generate does
        tokenizer.pad_token = tokenizer.eos_token
    try:
        encoded = tokenizer(texts, padding=True, return_tensors="pt", add_special_tokens=not chat)
    finally:
        tokenizer.padding_side, tokenizer.pad_token = side, pad
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def generate_batch(
    model,
    tokenizer,
    prompts: Sequence[str],
    draft_model=None,
    speculation: str | None = "adaptive",
    max_new_tokens: int = 128,
    chat: bool = True,
    **generate_kwargs,
) -> BatchGeneration:
    """Generate for every prompt in one left-padded batch with per-request proposal lengths.

    ``speculation``: "adaptive" | "fixed" (with ``num_speculative_tokens``) | None (plain batched
    ``generate``); ``draft_model`` None drafts by prompt lookup. Greedy unless ``do_sample=True``.

    Raises:
        ValueError: no prompts, an empty prompt, a ``max_new_tokens`` that is not an integer >= 1 (a bool or a
            float is refused), or settings ``generate`` rejects.
    """
    _check_integer("max_new_tokens", max_new_tokens)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    enable(model)
    inputs = {k: v.to(model.device) for k, v in encode_batch(tokenizer, prompts, chat).items()}
    generate_kwargs.setdefault("do_sample", False)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is not None:
        generate_kwargs.setdefault("pad_token_id", pad_id)
    if speculation is None:
        sequences, stats = model.generate(**inputs, max_new_tokens=max_new_tokens, **generate_kwargs), None
    else:
        out = model.generate(
            **inputs,
            assistant_model=draft_model,
            speculation=speculation,
            max_new_tokens=max_new_tokens,
            return_dict_in_generate=True,
            **generate_kwargs,
        )
        sequences, stats = out.sequences, out.speculation
    new = sequences[:, inputs["input_ids"].shape[1] :]
    texts = tuple(tokenizer.batch_decode(new, skip_special_tokens=True))
    return BatchGeneration(texts, sequences, stats)
