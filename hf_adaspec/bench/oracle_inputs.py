"""Oracle inputs from a finished greedy run: what each drafter would have got accepted, position by
position, and the oracle's tokens/s for every drafter family the bench compares.

The target's greedy output is fixed (plain decoding), so acceptance is known in hindsight: one
teacher-forced draft forward over prompt + output gives the draft's greedy guess for every generated
token (``agree[i]``), and replaying prompt lookup on every prefix gives how much of its continuation
matches. ``oracle.oracle_schedule`` turns those runs into the fastest schedule, costed with the
controller's ``CostTable``; the target's prefill (timed here once) is added so the oracle's tokens/s
compares with a method's tokens/s over wall time.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import torch

from ..backend import hf_compat
from ..costs.table import CostTable
from ..proposers.prompt_lookup import find_continuation
from ..proposers.suffix import SuffixMemory, best_draft
from .oracle import OracleDrafter, agreement_runs, oracle_schedule

FAMILIES = ("draft", "lookup", "hybrid")


@dataclass(frozen=True)
class PromptOracle:
    """One prompt's oracle: generated tokens, the target prefill (ms), the draft's greedy agreement and
    prompt lookup's per-position hit rate over the decode tokens, oracle tokens/s per family, and a draft
    head's first-token agreement (NaN without one; replay's traces give it)."""

    question_id: int
    category: str
    new_tokens: int
    prefill_ms: float
    draft_agreement: float
    lookup_agreement: float
    tokens_per_s: dict[str, float]
    head_agreement: float = math.nan


@torch.no_grad()
def draft_agreement(draft: torch.nn.Module, sequence: torch.Tensor, prompt_len: int) -> list[bool]:
    """agree[j-1] for generated tokens j = 1..n-1 (token 0 comes from the prefill): whether the
    draft's greedy guess given the true prefix equals it. sequence: [1, T] long (prompt + n tokens)."""
    n = sequence.shape[1] - prompt_len
    if n < 2:
        return []
    logits = hf_compat.forward_logits(draft, sequence[:, :-1].to(draft.device), hf_compat.new_cache(draft), keep=n)
    guesses = logits[0, 1:].argmax(dim=-1).cpu()  # [n-1]: guesses for tokens 1..n-1
    return (guesses == sequence[0, prompt_len + 1 :].cpu()).tolist()


def lookup_runs(sequence: torch.Tensor, prompt_len: int, k_max: int, max_ngram: int = 3) -> list[int]:
    """runs[j-1] for generated tokens j = 1..n-1: leading tokens of prompt lookup's continuation (at
    most k_max) that equal the real next tokens. sequence: [1, T] long."""
    tokens, runs = sequence[0].cpu(), []
    for pos in range(prompt_len + 1, tokens.shape[0]):
        guess = find_continuation(tokens[:pos], max_ngram, 1, k_max)
        truth = tokens[pos : pos + guess.shape[0]]
        same = (guess[: truth.shape[0]] == truth).int()
        runs.append(int(same.cumprod(0).sum()) if same.numel() else 0)
    return runs


def costless_runs(sequence: torch.Tensor, prompt_len: int, k_max: int, max_ngram: int = 3) -> list[int]:
    """runs[j-1] as ``lookup_runs``, for the better of the two costless drafters at each position: prompt
    lookup, and suffix drafting over the sequence itself (its memory of earlier requests left out, so the
    bound is a little low where a request repeats an earlier one). sequence: [1, T] long."""
    tokens = sequence[0].cpu()
    memory = SuffixMemory()
    runs = []
    for pos, lookup in zip(
        range(prompt_len + 1, tokens.shape[0]), lookup_runs(sequence, prompt_len, k_max, max_ngram), strict=True
    ):
        guess = torch.tensor(best_draft(memory, tokens[:pos], prompt_len, k_max).tokens, dtype=torch.long)
        truth = tokens[pos : pos + guess.shape[0]]
        same = (guess[: truth.shape[0]] == truth).int()
        runs.append(max(lookup, int(same.cumprod(0).sum()) if same.numel() else 0))
    return runs


@torch.no_grad()
def time_prefill_ms(target: torch.nn.Module, prompt: torch.Tensor) -> float:
    """Wall ms of the target's forward over the prompt [1, T] (a fresh cache)."""
    start = time.perf_counter()
    hf_compat.forward_logits(target, prompt.to(target.device), hf_compat.new_cache(target), keep=1)
    return (time.perf_counter() - start) * 1000.0


def _family_rates(
    agree_runs: tuple[int, ...],
    lookup: OracleDrafter,
    has_draft: bool,
    costs: CostTable,
    n: int,
    catchup_tokens: int,
    prefill_ms: float,
    k_max: int,
) -> dict[str, float]:
    """Oracle tokens/s (prefill included) per family under ``costs``."""
    model = OracleDrafter(agree_runs, costs.draft_ms, catchup_tokens * costs.draft_catchup_ms)
    sets = {"draft": [model] if has_draft else [], "lookup": [lookup], "hybrid": [model, lookup] if has_draft else []}
    return {
        family: 1000.0 * n / (prefill_ms + oracle_schedule(drafters, k_max, costs.t_verify).time_ms)
        for family, drafters in sets.items()
        if drafters
    }


def prompt_oracle(
    target,
    draft,
    sequence: torch.Tensor,
    prompt_len: int,
    costs: CostTable,
    k_max: int,
    ids: tuple[int, str],
    reused: int = 0,
) -> PromptOracle:
    """Oracle tokens/s per family for one greedy output ``sequence`` [1, T]; ids = (question_id, category).

    draft: the draft model alone (its setup: ingesting the prompt at ``costs.draft_catchup_ms`` per
    token, less the ``reused`` prefix tokens its cache was seeded with, ``draft_prefix``); lookup: the
    costless drafters alone (prompt lookup and suffix drafting, ``costless_runs``); hybrid: all. Plain
    steps are always allowed.
    """
    n = sequence.shape[1] - prompt_len
    agree = draft_agreement(draft, sequence, prompt_len) if draft is not None else []
    lookup = OracleDrafter(tuple(costless_runs(sequence, prompt_len, k_max)))
    prefill = time_prefill_ms(target, sequence[:, :prompt_len])
    rates = functools.partial(
        _family_rates,
        tuple(agreement_runs(agree)),
        lookup,
        draft is not None,
        n=n,
        catchup_tokens=prompt_len - reused,
        prefill_ms=prefill,
        k_max=k_max,
    )
    hits = sum(1 for r in lookup.runs if r > 0)
    return PromptOracle(
        ids[0],
        ids[1],
        n,
        prefill,
        sum(agree) / len(agree) if agree else float("nan"),
        hits / len(lookup.runs) if lookup.runs else float("nan"),
        rates(costs),
    )
