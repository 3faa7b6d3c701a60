"""The speculative decoding loop (batch-shaped tensors; B = 1 until the batch scheduler lands).

Each step: the controller picks a drafter and k from what the drafters can offer; that drafter
proposes k tokens; the target verifies [last token, d_1..d_k] in one forward; greedy or lossless
speculative sampling keeps n ≤ k of them plus one bonus/correction token; the target's and every
drafter's state roll back to the accepted prefix.
k = 0 is a plain decoding step. Invariant: the target cache holds every token but the last.
A controller with a ``stop_rule`` (confidence-based drafting) hands the proposer a callable that may
end the proposal early, so its k is then an upper bound.
A controller whose ``uses_target`` is true gets the target's top probability at each kept verified
position through ``observe_target`` (``target_confidence``). A controller with ``observe_time`` gets
each step's realized draft and verify time (ms), so it can correct its cost table online
(``cost_tracking``).
A controller with ``hindsight`` true also gets, through ``observe_hindsight``, a trial of each costless
drafter (prompt lookup) on the steps it was not verified: its proposal scored against the emitted tokens.
A drafter's one-off catch-up cost is amortised over the expected remaining length, ``settings.horizon``
(generated, tokens left) → tokens: by default as many as generated so far (``horizon.lindy_horizon``);
``generate`` passes the target model's ``LengthMemory``, which learns it from past requests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import hf_compat
from .controller import Controller, Decision, DraftOption
from .hindsight import hindsight_trial, unverified_proposals
from .horizon import lindy_horizon
from .proposers.base import Proposal, Proposer
from .stats import SpeculationStats, StepRecord
from .verification import Verification, greedy_verify, speculative_sample


@dataclass
class DecodeSettings:
    """What the loop needs from the generation config: processors, stopping, budget, sampling."""

    logits_processor: object
    stopping_criteria: object
    max_length: int
    do_sample: bool
    k_max: int
    streamer: object | None = None
    generator: torch.Generator | None = None
    on_step: Callable[[StepRecord | None, torch.Tensor], None] | None = None  # (record, tokens [m])
    horizon: Callable[[int, int], int] = lindy_horizon  # (generated, tokens left) → tokens still to come


@dataclass(frozen=True)
class DecodeResult:
    """sequences: [B, T + new] long (prompt included); stats: every step's decision."""

    sequences: torch.Tensor
    stats: SpeculationStats


def process_scores(processor, ids: torch.Tensor, draft: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Apply logits processors position by position: scores_i sees ids + d_<i. logits: [B, k+1, V]."""
    if not processor:
        return logits
    rows = [processor(torch.cat([ids, draft[:, :i]], dim=1), logits[:, i]) for i in range(logits.shape[1])]
    return torch.stack(rows, dim=1)  # [B, k+1, V]


def select_token(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row from processed scores [B, V] → [B, 1]."""
    if do_sample:
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)
    return scores.argmax(dim=-1, keepdim=True)


def verify_proposal(proposal: Proposal, scores: torch.Tensor, settings: DecodeSettings) -> Verification:
    """Greedy or speculative-sampling verification of ``proposal`` against target scores [B, k+1, V]."""
    if not settings.do_sample:
        return greedy_verify(proposal.tokens, scores)
    p = torch.softmax(scores, dim=-1)  # [B, k+1, V]
    q = proposal.q
    if q is None:  # deterministic drafter: q is one-hot on its tokens
        q = torch.nn.functional.one_hot(proposal.tokens, p.shape[-1]).to(p.dtype)  # [B, k, V]
    return speculative_sample(proposal.tokens, q, p, settings.generator)


def append_tokens(ids: torch.Tensor, new: torch.Tensor, settings: DecodeSettings) -> tuple[torch.Tensor, bool]:
    """Append new tokens [1, m] one at a time, stopping at the first token a criterion stops on."""
    for i in range(new.shape[1]):
        ids = torch.cat([ids, new[:, i : i + 1]], dim=1)
        if bool(settings.stopping_criteria(ids, None).all()):
            return ids, True
    return ids, False


@torch.no_grad()
def speculative_decode(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    proposers: Sequence[Proposer],
    controller: Controller,
    settings: DecodeSettings,
) -> DecodeResult:
    """Generate from ``target`` with speculation. input_ids: [1, T] long → DecodeResult."""
    stats, start = SpeculationStats(), time.perf_counter()
    prompt_len, cache = input_ids.shape[1], hf_compat.new_cache(target)
    logits = hf_compat.forward_logits(target, input_ids, cache, keep=1)  # [1, 1, V]
    token = select_token(settings.logits_processor(input_ids, logits[:, -1]), settings.do_sample, settings.generator)
    ids, done = append_tokens(input_ids, token, settings)
    stats.prefill_ms = (time.perf_counter() - start) * 1000.0
    _stream(settings, ids[:, prompt_len:], None)
    while not done:
        length = ids.shape[1]
        budget = settings.max_length - length - 1  # draft tokens that still fit before max_length
        options = [DraftOption(i, max(0, min(budget, p.available(ids, settings.k_max))), p.catchup_tokens(ids))
                   for i, p in enumerate(proposers)]
        decision = controller.choose(options, settings.horizon(length - prompt_len, budget + 1))
        proposer = proposers[decision.drafter]
        hindsight = getattr(controller, "hindsight", False)  # score costless drafters it does not verify
        unverified = unverified_proposals(proposers, options, decision, ids) if hindsight else {}
        t0 = time.perf_counter()
        proposal = _propose(proposer, controller, ids, decision)
        t1 = time.perf_counter()
        step_ids = torch.cat([ids[:, -1:], proposal.tokens], dim=1)  # [1, k+1]
        logits = hf_compat.forward_logits(target, step_ids, cache, keep=step_ids.shape[1])  # [1, k+1, V]
        scores = process_scores(settings.logits_processor, ids, proposal.tokens, logits)  # [1, k+1, V]
        result = verify_proposal(proposal, scores, settings)
        n = int(result.num_accepted[0])
        hf_compat.rollback(cache, length + n)
        for p in proposers:
            p.rollback(length + n)
        controller.observe(decision.drafter, proposal.k, n, confidences=proposal.confidences)
        if getattr(controller, "uses_target", False):
            top = torch.softmax(scores[0, : n + 1].float(), dim=-1).amax(dim=-1)  # [n+1]: p_max per position
            controller.observe_target(decision.drafter, proposal.k, n, proposal.confidences, tuple(top.tolist()))
        new = torch.cat([proposal.tokens[:, :n], result.next_token[:, None]], dim=1)  # [1, n+1]
        for d, proposed in unverified.items():  # [L]: what a costless drafter would have proposed
            controller.observe_hindsight(d, hindsight_trial(proposed, new[0]))
        ids, done = append_tokens(ids, new, settings)
        t2 = time.perf_counter()
        if hasattr(controller, "observe_time"):
            catchup = options[decision.drafter].catchup_tokens
            controller.observe_time(decision.drafter, proposal.k, catchup, (t1 - t0) * 1000.0, (t2 - t1) * 1000.0)
        record = StepRecord(proposal.k, n, ids.shape[1] - length, proposer.name if proposal.k else "plain",
                            (t1 - t0) * 1000.0, (t2 - t1) * 1000.0, decision.alpha, decision.predicted_goodput)
        stats.steps.append(record)
        _stream(settings, ids[:, length:], record)
    if settings.streamer is not None:
        settings.streamer.end()
    stats.cost_scale = controller.tracker.scale if hasattr(controller, "tracker") else None
    stats.wall_ms, stats.new_tokens = (time.perf_counter() - start) * 1000.0, ids.shape[1] - prompt_len
    return DecodeResult(sequences=ids, stats=stats)


def _propose(proposer: Proposer, controller: Controller, ids: torch.Tensor, decision: Decision) -> Proposal:
    """Up to decision.k draft tokens [1, k'], ended early by the controller's ``stop_rule`` if it has one."""
    if not decision.k:
        return Proposal(ids[:, :0])
    stop_rule = getattr(controller, "stop_rule", None)
    stop = stop_rule(decision.drafter) if stop_rule is not None else None  # None: this drafter is not stopped early
    if stop is None:
        return proposer.propose(ids, decision.k)
    return proposer.propose(ids, decision.k, stop=stop)


def _stream(settings: DecodeSettings, tokens: torch.Tensor, record: StepRecord | None) -> None:
    """Hand newly emitted tokens [1, m] to the streamer and the step observer (record None: prefill)."""
    if settings.streamer is not None and tokens.numel():
        settings.streamer.put(tokens.cpu())
    if settings.on_step is not None:
        settings.on_step(record, tokens[0].cpu())
