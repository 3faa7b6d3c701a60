"""Benchmark: plain vs transformers' assisted generation / prompt lookup vs fixed-k, p_min and adaptive.

"hf-assisted" is transformers' assisted generation with its defaults, which already stop drafting
once the assistant's token probability falls below ``assistant_confidence_threshold=0.4``.
"fixed-k" drafts k tokens with the draft model every step; "pmin" is the llama.cpp-style baseline
(``speculation="fixed"`` with k = 8 and ``draft_p_min=0.75``); "adaptive" is the library's policy with
the draft model, "adaptive-lookup" without one (prompt lookup only); "plain-again" times plain decoding
a second time, an A/A control whose speedup is the run's noise.

Methods run interleaved per prompt (the order rotates from prompt to prompt) so machine drift hits
every method alike; each run is greedy, so every method's output is also checked against plain. Each
hf-adaspec method learns into a state of its own, and every timed run starts from that state as it was
before the prompt (no run is timed with its own answer in memory: suffix drafting would recall it).
Reported per category (``summary``): tokens/s (new tokens over wall time, prefill included) and speedup vs
plain (geometric mean of per-prompt ratios); overall: geometric mean over all prompts.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..backend import hf_compat
from ..engine.run import SpeculationState
from .oracle_inputs import PromptOracle, prompt_oracle
from .prompts import Prompt

METHODS = (
    "plain",
    "plain-again",
    "hf-assisted",
    "hf-prompt-lookup",
    "fixed-k",
    "pmin",
    "adaptive",
    "adaptive-fixed-threads",
    "adaptive-lookup",
)
NEEDS_DRAFT = (
    "hf-assisted",
    "fixed-k",
    "pmin",
    "adaptive",
    "adaptive-fixed-threads",
)  # methods that run the draft model

# which oracle bounds a method: the drafters it may use (plain has none)
METHOD_FAMILY = {
    "hf-assisted": "draft",
    "hf-prompt-lookup": "lookup",
    "fixed-k": "draft",
    "pmin": "draft",
    "adaptive": "hybrid",
    "adaptive-fixed-threads": "hybrid",
    "adaptive-lookup": "lookup",
}


@dataclass(frozen=True)
class Run:
    """One timed generation: tokens/s over wall time (``seconds``: the median of the timed repeats), and whether
    it equals plain greedy; ``repeat_seconds``: every timed repeat's seconds in round order (each round times
    every method once, so the i-th entries of two methods are a pair)."""

    question_id: int
    category: str
    method: str
    new_tokens: int
    seconds: float
    tokens_per_s: float
    matches_plain: bool
    mean_accepted_length: float | None = None
    plain_share: float | None = None
    divergence_gap: float | None = None
    acceptance: float | None = None
    mean_k: float | None = None
    oracle_tokens_per_s: float | None = None
    draft_prefix_tokens: int | None = None
    repeat_seconds: tuple[float, ...] = ()


@dataclass(frozen=True)
class PromptResult:
    """Every method's run on one prompt, and the prompt's oracle (None without a cost table)."""

    runs: list[Run]
    oracle: PromptOracle | None = None


def method_kwargs(method: str, draft, fixed_k: int) -> dict:
    """generate() keyword arguments for one method (all greedy).

    Raises:
        ValueError: an unknown method, naming the valid ones.
    """
    table = {
        "plain": {},
        "plain-again": {},  # an A/A control: plain decoding timed again, its speedup is the run's noise
        "hf-assisted": {"assistant_model": draft},
        "hf-prompt-lookup": {"prompt_lookup_num_tokens": 10},
        "fixed-k": {"assistant_model": draft, "speculation": "fixed", "num_speculative_tokens": fixed_k},
        "pmin": {"assistant_model": draft, "speculation": "fixed", "num_speculative_tokens": 8, "draft_p_min": 0.75},
        "adaptive": {"assistant_model": draft, "speculation": "adaptive"},
        "adaptive-fixed-threads": {"assistant_model": draft, "speculation": "adaptive", "adapt_threads": False},
        "adaptive-lookup": {"speculation": "adaptive"},
    }
    if method not in table:
        raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
    return dict(table[method])


def _timed(generate: Callable[..., object], inputs: dict, kwargs: dict, max_new_tokens: int):
    start = time.perf_counter()
    out = generate(**inputs, **kwargs, max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
    return out, time.perf_counter() - start


def _state_for(states: dict, before: dict | None, method: str, repeat: int) -> SpeculationState:
    """The state a timed run of ``method`` starts from: on the first repeat the method's own (created on first
    use; what it learns is kept for the prompts that follow), on a later repeat a copy of it as it was before
    this prompt (``before``, filled on the first repeat when ``before`` is not None)."""
    state = states.setdefault(method, SpeculationState())
    if repeat == 0:
        if before is not None:
            before[method] = copy.deepcopy(state)
        return state
    return copy.deepcopy(before[method])


def run_prompt(model, tokenizer, draft, prompt: Prompt, methods: list[str], rotation: int, cfg: dict) -> PromptResult:
    """Run every method ``cfg["repeats"]`` times on one prompt, in rotated order (median time);
    compare outputs with plain; with ``cfg["costs"]`` (context tokens → the controller's CostTable) also
    the oracle. Each hf-adaspec method learns into its own ``SpeculationState`` in ``cfg["states"]`` (a dict;
    created there on first use; without it, fresh ones for this call), as if it were the only method a user
    ran. Every repeat starts from the method's state as it was before this prompt: the first repeat runs on
    the state itself (what it learns is kept for the next prompts), a later one on a copy taken before the
    first, so no run is timed with this prompt's answer already in memory."""
    inputs = tokenizer.apply_chat_template(
        prompt.messages(), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    prompt_len = inputs["input_ids"].shape[1]
    order = methods[rotation % len(methods) :] + methods[: rotation % len(methods)]
    outputs: dict[str, tuple] = {}
    seconds: dict[str, list[float]] = {m: [] for m in methods}
    repeats, states = cfg.get("repeats", 1), cfg.get("states", {})
    before: dict | None = {} if repeats > 1 else None
    for repeat in range(repeats):  # every method once per round: drift hits all alike
        for method in order:
            kwargs = method_kwargs(method, draft, cfg["fixed_k"])
            if "speculation" in kwargs:
                kwargs["speculation_state"] = _state_for(states, before, method, repeat)
            outputs[method] = _timed(model.generate, inputs, kwargs, cfg["max_new_tokens"])
            seconds[method].append(outputs[method][1])
    plain_seq = outputs["plain"][0].sequences if "plain" in outputs else None
    reused = [getattr(getattr(out, "speculation", None), "draft_prefix_tokens", 0) for out, _ in outputs.values()]
    oracle = None
    if plain_seq is not None and cfg.get("costs") is not None:  # the draft's catch-up less the best reused prefix
        oracle = prompt_oracle(
            model,
            draft,
            plain_seq,
            prompt_len,
            cfg["costs"](prompt_len),
            cfg.get("k_max", 8),
            (prompt.question_id, prompt.category),
            max(reused),
        )
    runs = [_run(model, prompt, m, outputs[m][0], seconds[m], prompt_len, plain_seq, oracle) for m in methods]
    return PromptResult(runs, oracle)


def _run(model, prompt: Prompt, method: str, out, seconds: list[float], prompt_len: int, plain_seq, oracle) -> Run:
    """One method's row: its median time over ``seconds``, its output against plain's ``plain_seq`` (where plain
    ran), its speculation statistics (none for plain) and the oracle's bound for its family (where priced)."""
    elapsed, new = statistics.median(seconds), out.sequences.shape[1] - prompt_len
    stats = getattr(out, "speculation", None)
    gap = divergence_gap(model, plain_seq, out.sequences) if plain_seq is not None else None
    family = METHOD_FAMILY.get(method)
    bound = oracle.tokens_per_s.get(family) if oracle is not None and family else None
    return Run(
        prompt.question_id,
        prompt.category,
        method,
        new,
        elapsed,
        new / elapsed,
        plain_seq is not None and gap is None,
        stats.mean_accepted_length if stats else None,
        stats.plain_share if stats else None,
        gap,
        stats.acceptance_rate if stats else None,
        stats.mean_k if stats else None,
        bound,
        stats.draft_prefix_tokens if stats else None,
        tuple(seconds),
    )


def divergence_gap(model, plain: torch.Tensor, other: torch.Tensor) -> float | None:
    """Where ``other`` [1, T'] first differs from ``plain`` [1, T], the target's top-1 minus top-2
    logit after the common prefix (a near-tie when small); None if neither differs; inf when one is a
    strict prefix of the other (never a near-tie)."""
    n = min(plain.shape[1], other.shape[1])
    diff = (plain[0, :n] != other[0, :n]).nonzero()
    if not diff.numel():
        return None if plain.shape[1] == other.shape[1] else float("inf")
    with torch.no_grad():
        cache = hf_compat.new_cache(model)
        logits = hf_compat.forward_logits(model, plain[:, : int(diff[0])], cache, keep=1)[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])
