"""What the Spec-Bench diagnostic scripts share: their prompt options, the default Qwen pair (NF4) and a
session of bench methods, each learning into its own state."""

import argparse

import hf_adaspec
from hf_adaspec.api.generate import SpeculationState, enable
from hf_adaspec.tools.bench import method_kwargs


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


class MethodSession:
    """The default pair and one ``SpeculationState`` per bench method (as ``hf-adaspec bench`` keeps
    them), for scripts that run several methods on the same prompts."""

    def __init__(self, methods: str) -> None:
        self.model, self.tokenizer, self.draft = load_pair()
        self.methods = methods.split(",")
        self.states = {m: SpeculationState() for m in self.methods}

    def generate(self, text: str, method: str, max_new_tokens: int):
        """One greedy request of ``method`` (``hf-adaspec bench``'s keywords) on a user message, learning
        into the method's state; the output has ``.speculation``."""
        return self.model.generate(**chat_inputs(self.tokenizer, text), **method_kwargs(method, self.draft, 5),
                                   speculation_state=self.states[method], max_new_tokens=max_new_tokens,
                                   do_sample=False, return_dict_in_generate=True)
