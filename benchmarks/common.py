"""What the Spec-Bench diagnostic scripts share: their prompt options and the default Qwen pair (NF4)."""

import argparse

import hf_adaspec
from hf_adaspec.integration import enable


def prompt_options(ap: argparse.ArgumentParser) -> None:
    """--per-category, --max-new-tokens and --questions, as ``hf-adaspec bench`` takes them."""
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--questions", default="../shared/data/spec_bench/question.jsonl")


def load_pair():
    """The default target (its ``generate`` speculation-enabled), its tokenizer and the default draft model."""
    target = hf_adaspec.load(hf_adaspec.DEFAULT_TARGET)
    draft = hf_adaspec.load(hf_adaspec.DEFAULT_DRAFT, quantize_lm_head=True)
    enable(target.model)
    return target.model, target.tokenizer, draft.model


def chat_inputs(tokenizer, text: str) -> dict:
    """One user turn with the chat template: input_ids and attention_mask, [1, T]."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)
