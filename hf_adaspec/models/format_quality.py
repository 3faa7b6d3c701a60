"""The quality side of ``quantization="auto"`` (``format_choice``): how closely a weight format follows the dense model.

The dense model's greedy continuations of ``QUALITY_PROMPTS`` are the reference; a format reads them
teacher-forced, one forward per prompt, on its decoding path (q4 layers on the kernel, not the dense route a long
prefill takes), and is scored by its top-1 agreement (the share of reference tokens that are its own argmax) and
its first divergence (where its free-running greedy output would leave the dense one).
"""

from __future__ import annotations

import statistics

import torch

from ..kernels.route import kernel_only

QUALITY_PROMPTS = (
    "The history of the printing press begins",
    'def merge_sorted(a, b):\n    """Merge two sorted lists into one sorted list."""\n',
    "Three tips for keeping a small vegetable garden healthy through a dry summer are",
)


def dense_reference(model: torch.nn.Module, tokenizer, new_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The dense model's greedy continuation of each of ``QUALITY_PROMPTS`` (``greedy_reference``)."""
    return greedy_reference(
        model, [tokenizer(p, return_tensors="pt")["input_ids"][0] for p in QUALITY_PROMPTS], new_tokens
    )


def greedy_reference(
    model: torch.nn.Module, prompts: list[torch.Tensor], new_tokens: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``model``'s greedy continuation of each prompt (token ids [T_i]), generated as one left-padded batch:
    (prompt ids [T_i], new ids [new_tokens]) per prompt."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, T]
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = p, 1
    with torch.inference_mode():
        out = model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )  # [B, T + new]
    return [(p, out[row, width:].cpu()) for row, p in enumerate(prompts)]


def agreement(model: torch.nn.Module, refs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """(top-1 agreement, mean first divergence in tokens) of ``model`` on the dense greedy continuations
    ``refs``, teacher-forced: one forward over each prompt and its continuation, q4 layers on the kernel
    (``kernels.route.kernel_only``: each row multiplied as decoding multiplies it)."""
    hits, firsts = [], []
    with torch.inference_mode(), kernel_only(model):
        for prompt, new in refs:
            seq = torch.cat([prompt, new[:-1]])[None].to(model.device)  # [1, T + G - 1]
            logits = model(seq).logits[0, len(prompt) - 1 :]  # [G, V]: the prediction of each new token
            same = logits.argmax(-1).cpu() == new  # [G]
            hits.append(same.float())
            firsts.append(len(same) if bool(same.all()) else int(same.logical_not().nonzero()[0]))
    return float(torch.cat(hits).mean()), statistics.mean(firsts)
