"""The speculative decoding loop, over the B rows of a left-padded batch (a single request is B = 1).

Each step reads decide → propose → verify → commit → observe: every drafter offers what it could propose
for each active row, the controller picks a drafter and k_i per row; each drafter proposes at once for the
rows that picked it (the controller's stop rule may end the draft model's proposal early); the target
verifies every row's [last token, d_1..d_{k_i}] in one forward (right-padded to k+1 columns); greedy or
lossless speculative sampling keeps n_i ≤ k_i tokens plus a bonus/correction token per row; the target's
cache and every drafter commit the confirmed tokens per row (``RaggedCache``: rejected positions become
masked holes, cropped when no row needs them), and rows that stop (EOS, max_new_tokens, a stopping
criterion) leave the batch; the controller learns from the outcome, a costless drafter's whole offer
scored in hindsight against the emitted tokens, and every step's time (rested ones too) is booked in the
controller's slowdown ledger (``Controller.account``) at the time the decision's pricing predicts for it
(``Decision.price``). The controller builds the step's view of the offers only when it decides: k_i = 0 is a
plain step; a step it rests (``Decision.rested``) is one with no offers, plan, hindsight or observation.
Invariant: the target cache holds every token of a row but its last. Greedy rows equal their plain
greedy output where the forward is shape-stable; sampling is lossless per row.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..backend import hf_compat
from ..backend.ragged import KVCache, right_pad
from ..policy.controller import Controller, Decision, StepOutcome, StepView
from ..policy.horizon import lindy_horizon
from ..proposers.base import Drafter, DraftOffer, Proposal, Proposals, Rows
from .hindsight import scored
from .rows import TokenRows
from .stats import SpeculationStats, StepRecord
from .threads import ThreadChooser
from .verification import Verification, greedy_verify, process_scores, select_token, speculative_sample



@dataclass
class DecodeSettings:
    """What the loop needs from the generation config: processors, stopping, the length budget (tokens),
    sampling, pad and EOS ids, the target's logits width V (a draft model with a narrower output head
    has its logits padded to it; 0: not given), and at batch size 1 the streamer and the step callback
    ``on_step(record, tokens [m])``; ``threads``: the chooser of torch's thread count per step (None: left
    as set; the caller restores it); ``decision_ms``: what the controller hears a decision cost (ms; None:
    the offers, decision and hindsight as timed); ``step_ms``: a step's time as the controller books it,
    (measured ms, decided, predicted ms) → ms (None: as measured; ``predicted_time``: as the controller's
    costs price it; a replay prices its forwards)."""

    logits_processor: object
    stopping_criteria: object
    max_length: int
    do_sample: bool
    pad_token_id: int = 0
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0
    streamer: object | None = None
    generator: torch.Generator | None = None
    on_step: Callable[[StepRecord | None, torch.Tensor], None] | None = None
    horizon: Callable[[int, int], int] = lindy_horizon  # (generated, tokens left) → tokens still to come
    threads: ThreadChooser | None = None  # picks torch's thread count per step; None: left as set
    decision_ms: float | None = None  # a decision's engine time as priced (a replay); None: measured
    step_ms: Callable[[float, bool, float], float] | None = None  # a step's booked time; None: measured


@dataclass(frozen=True)
class RunParts:
    """What one request runs on: the target's empty cache ([B] rows), the drafters in the controller's
    order, the controller, the settings, k_max (the most tokens any drafter may offer a row per step) and
    the target layers whose inputs the drafters read (a draft head's features; empty: none recorded)."""

    cache: KVCache
    drafters: tuple[Drafter, ...]
    controller: Controller
    settings: DecodeSettings
    k_max: int
    feature_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class DecodeResult:
    """sequences: [B, T + new] long (left-padded prompts, rows right-padded with the pad id)."""

    sequences: torch.Tensor
    stats: SpeculationStats


def verify_group(proposals: Sequence[Proposal], scores: torch.Tensor, settings: DecodeSettings) -> Verification:
    """Speculative-sampling verification of g rows' ``proposals`` of one length k against their processed
    scores [g, k+1, V], in one call on the CPU, where its generator is (a deterministic drafter's q is one-hot on
    its tokens)."""
    draft = torch.cat([proposal.tokens for proposal in proposals])  # [g, k]
    p = torch.softmax(scores.cpu(), dim=-1)  # [g, k+1, V]
    q = torch.cat([torch.nn.functional.one_hot(proposal.tokens, p.shape[-1]).to(p.dtype) if proposal.q is None
                   else proposal.q.cpu() for proposal in proposals])  # [g, k, V]
    return speculative_sample(draft, q, p, settings.generator)


class _Once:
    """A zero-argument call made at most once, its value kept (``functools.cache`` costs more to make)."""

    __slots__ = ("fn", "value")

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn, self.value = fn, _UNSET

    def __call__(self) -> object:
        if self.value is _UNSET:
            self.value = self.fn()
        return self.value


_UNSET = object()


def _decide(rows: TokenRows, current: Callable[[], Rows], parts: RunParts
            ) -> tuple[tuple[DraftOffer, ...], StepView | None, Decision]:
    """The controller's decision, and the offers and view it was decided from (built once, when the controller
    asks, or after a decision it did not rest: hindsight scores the offers); ((), None) for a rest."""
    built = _Once(lambda: _offers(rows, current, parts))
    decision = parts.controller.decide(len(rows.active), lambda: built()[1])
    offers, view = ((), None) if decision.rested else built()
    return offers, view, decision


def _offers(rows: TokenRows, current: Callable[[], Rows], parts: RunParts) -> tuple[tuple[DraftOffer, ...], StepView]:
    """Every drafter's offer, and the view of them the controller decides from: their bounds (capped by each
    row's budget), their evidence, the drafters' catch-up, and the horizon of the shortest row and the smallest
    budget."""
    settings = parts.settings
    budget = [settings.max_length - rows.ends[i] - 1 for i in rows.active]
    offers = tuple(d.offer(current(), parts.k_max) for d in parts.drafters)
    bounds = tuple(tuple(max(0, min(b, u)) for b, u in zip(budget, o.bounds, strict=True)) for o in offers)  # [D][b]
    generated = min(rows.ends[i] for i in rows.active) - rows.prompt_width
    horizon = settings.horizon(generated, min(budget) + 1)
    view = StepView(bounds, tuple(o.catchup for o in offers), horizon, tuple(o.evidence for o in offers))
    return offers, view


def _propose(parts: RunParts, current: Callable[[], Rows], offers: Sequence[DraftOffer], decision: Decision
             ) -> Proposals:
    """Each row's proposal from its drafter, flat; a drafter runs once for all rows that picked it."""
    made: list[Proposals | None] = [None] * len(parts.drafters)
    for d, drafter in enumerate(parts.drafters):
        ks = [k if chosen == d else 0 for k, chosen in zip(decision.ks, decision.drafters, strict=True)]
        if max(ks):
            made[d] = drafter.propose(current(), offers[d], ks, stop=decision.stop(d))
    if all(m is None for m in made):
        return Proposals.empty(len(decision.ks))
    return Proposals.merge(made, decision.drafters)


def _block(rows: TokenRows, proposals: Proposals, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each active row's [last token, d_1..d_k_i], right-padded → tokens [b, K+1] and valid [b, K+1] bool (None
    when every row has the same k: no padding)."""
    ks = proposals.ks
    if len(rows.active) == 1:
        i = rows.active[0]
        last = rows.ids[i : i + 1, rows.ends[i] - 1 : rows.ends[i]]  # [1, 1]
        return (torch.cat([last, proposals.tokens[None]], dim=1) if ks[0] else last), None  # [1, k+1]
    last = [rows.ids[i, rows.ends[i] - 1 : rows.ends[i]] for i in rows.active]  # b × [1]
    if min(ks) == max(ks):
        return torch.cat([torch.stack(last), proposals.tokens.view(len(ks), ks[0])], dim=1), None  # [b, k+1]
    rows_k = [torch.cat([t, proposals.tokens[a:b]]) for t, a, b in zip(last, proposals.offsets, proposals.offsets[1:])]
    return right_pad(rows_k, pad_token_id)


def _scores(logits: torch.Tensor, proposals: Proposals, rows: TokenRows, settings: DecodeSettings,
            free: bool) -> torch.Tensor:
    """The target's logits [b, K+1, V] (right-padded: row s's first k_s + 1 columns are its own) processed:
    position-free processors once over every column of every row (``hf_compat.position_free``), others per row
    and position on the row's own prefix (``process_scores``)."""
    processor = settings.logits_processor
    if not processor:
        return logits
    b, width, vocab = logits.shape
    if free:  # they read only the scores: the ids they are handed are ignored
        ids = torch.zeros(b * width, 1, dtype=torch.long, device=logits.device)
        return processor(ids, logits.reshape(b * width, vocab)).reshape(b, width, vocab)  # [b, K+1, V]
    done = [process_scores(processor, rows.view(i)[None], p.tokens, logits[s : s + 1, : p.k + 1])  # [1, k_s+1, V]
            for s, (i, p) in enumerate(zip(rows.active, proposals, strict=True))]
    return torch.cat([torch.nn.functional.pad(d, (0, 0, 0, width - d.shape[1])) for d in done])  # [b, K+1, V]


def _verify(logits: torch.Tensor, proposals: Proposals, rows: TokenRows, settings: DecodeSettings,
            free: bool) -> tuple[list[int], list[list[int]]]:
    """Verify every row's proposal against its logits (``logits`` [b, K+1, V] on the target's device) → accepted
    n_i and the new tokens [n_i + 1] (ids on the host). Greedy: all rows in one call, one host read; sampling:
    the rows of one k_i in one call (``verify_group``), one host read per group."""
    if not settings.do_sample and not proposals.tokens.numel():  # greedy plain rows: the target's argmax
        scores = _scores(logits[:, :1], proposals, rows, settings, free)  # [b, 1, V]
        return [0] * len(proposals), [[t] for t in scores[:, 0].argmax(dim=-1).tolist()]
    drafts = proposals.rows()  # the proposals are on the host
    width = max(len(d) for d in drafts) + 1
    scores = _scores(logits[:, :width], proposals, rows, settings, free)  # [b, K+1, V]
    if not settings.do_sample:
        padded = torch.tensor([d + [-1] * (width - 1 - len(d)) for d in drafts], dtype=torch.long)  # [b, K]
        result = greedy_verify(padded.to(scores.device), scores)  # a padded column never matches
        accepted, tokens = torch.stack([result.num_accepted, result.next_token]).tolist()  # one host read
    else:
        accepted, tokens = [0] * len(proposals), [0] * len(proposals)
        for k in sorted(set(proposals.ks)):
            group = [s for s, n in enumerate(proposals.ks) if n == k]
            result = verify_group([proposals[s] for s in group], scores[group, : k + 1], settings)
            both = torch.cat([result.num_accepted, result.next_token]).tolist()  # one transfer per group
            for j, s in enumerate(group):
                accepted[s], tokens[s] = both[j], both[len(group) + j]
    return accepted, [d[:n] + [t] for d, n, t in zip(drafts, accepted, tokens, strict=True)]


def _commit(parts: RunParts, finished: list[bool], confirmed: torch.Tensor, own: Sequence[torch.Tensor],
            features: list[torch.Tensor] | None) -> None:
    """Roll the target's cache back to the ``confirmed`` [b] tokens per row and each drafter to its ``own``
    [b] (a drafter keeps its tokens only where they were accepted), handing each the target's ``features``
    of the confirmed positions (per row [c_i, F], None when not recorded); then finished rows leave the
    batch, unless every row finished (the caches stay whole: the draft's may seed a later request)."""
    left = [s for s, f in enumerate(finished) if not f]
    keep = torch.tensor(left, dtype=torch.long) if 0 < len(left) < len(finished) else None
    parts.cache.rollback(confirmed)
    if keep is not None:
        parts.cache.select(keep)
    for drafter, lengths in zip(parts.drafters, own, strict=True):
        drafter.commit(lengths, keep, features)


def _own(drafter: int, chosen: Sequence[int], confirmed: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """What drafter ``drafter`` keeps per row ([b] long): the ``confirmed`` tokens where it drafted this step
    (``chosen``: each row's drafter), else what the row ``held`` before it."""
    mine = [d == drafter for d in chosen]
    return confirmed if all(mine) else held if not any(mine) else torch.where(torch.tensor(mine), confirmed, held)


def _leave(parts: RunParts, rows: TokenRows, finished: list[bool]) -> None:
    """The controller forgets finished rows, and they leave the active rows."""
    left = [s for s, f in enumerate(finished) if not f]
    if 0 < len(left) < len(finished):
        parts.controller.select(torch.tensor(left, dtype=torch.long))
    rows.active = [rows.active[s] for s in left]


def _prefill(parts: RunParts, rows: TokenRows, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             now: Callable[[], float]) -> None:
    """The prompt's forward and each row's first token; rows that stopped at it leave, and drafters that read
    the target's features get the prompt's."""
    settings, batch = parts.settings, input_ids.shape[0]
    logits, features = parts.cache.append_features(input_ids, attention_mask.bool(), 1, parts.feature_layers)
    logits = logits[:, -1].cpu() if settings.do_sample else logits[:, -1]  # [B, V]; sampling on the CPU
    firsts = [int(select_token(settings.logits_processor(rows.view(i)[None].to(logits.device), logits[i : i + 1]),
                               settings.do_sample, settings.generator)) for i in range(batch)]  # B ids
    finished = [rows.emit(i, [t], now()) for i, t in enumerate(firsts)]
    _stream(settings, rows.ids[0, input_ids.shape[1] : rows.ends[0]], None)
    if any(finished) or features is not None:  # the prompt's features; rows that stopped at their first token leave
        held = rows.current().lengths - 1  # the caches hold at most the prompt: nothing to roll back
        prompt = None if features is None else [features[i][attention_mask[i].bool()] for i in range(batch)]
        _commit(parts, finished, held, [held] * len(parts.drafters), prompt)  # prompt: B × [T_i, F]
    _leave(parts, rows, finished)


@torch.no_grad()
def speculative_decode(parts: RunParts, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> DecodeResult:
    """Generate for a left-padded batch with ``parts`` (its cache empty). input_ids, attention_mask: [B, T]
    → DecodeResult."""
    start, settings = time.perf_counter(), parts.settings
    now = lambda: (time.perf_counter() - start) * 1000.0  # noqa: E731
    rows = TokenRows.open(input_ids, attention_mask, settings.max_length, settings.stopping_criteria,
                          settings.pad_token_id)
    free, stats = hf_compat.position_free(settings.logits_processor), SpeculationStats()
    _prefill(parts, rows, input_ids, attention_mask, now)
    stats.prefill_ms = now()
    step, last = 0, time.perf_counter()
    while rows.active:
        current, mark = _Once(rows.current), time.perf_counter()  # the drafters' view, built if one is asked
        offers, view, decision = _decide(rows, current, parts)
        rest, decision_s = decision.rested, time.perf_counter() - mark  # decide
        threads = _set_threads(settings.threads, parts.controller.may_explore())
        tried = threads is not None and threads != settings.threads.best  # a thread count tried: not a plain step
        t0 = time.perf_counter()
        proposals = _propose(parts, current, offers, decision)  # propose
        t1 = time.perf_counter()
        block, valid = _block(rows, proposals, settings.pad_token_id)  # [b, K+1]
        logits, features = parts.cache.append_features(block, valid, block.shape[1], parts.feature_layers)
        accepted, new = _verify(logits, proposals, rows, settings, free)  # verify
        mark = time.perf_counter()
        seen = () if view is None else scored(offers, view, new)
        decision_ms = (decision_s + time.perf_counter() - mark) * 1000.0 if settings.decision_ms is None \
            else settings.decision_ms
        held = torch.tensor([rows.ends[i] - rows.starts[i] for i in rows.active])  # [b] tokens held before the step
        confirmed = held + torch.tensor(accepted)  # tokens each row holds, minus its new last token
        ends = [rows.ends[i] for i in rows.active]
        finished = [rows.emit(s, n, now()) for s, n in enumerate(new)]
        own = [_own(d, decision.drafters, confirmed, held) for d in range(len(parts.drafters))]
        kept = None if features is None else [features[s, : n + 1] for s, n in enumerate(accepted)]  # [n_i+1, F]
        _commit(parts, finished, confirmed, own, kept)  # commit
        ks = proposals.ks
        draft_ms, verify_ms = (t1 - t0) * 1000.0, (time.perf_counter() - t1) * 1000.0
        outcome = StepOutcome(decision.drafters, ks, tuple(accepted), proposals.confidences or ((),) * len(ks), seen,
                              decision_ms)
        predicted_ms = decision.price(outcome)
        if threads is not None:
            settings.threads.observe(threads, draft_ms + verify_ms, predicted_ms)
        if not rest:
            parts.controller.observe(decision, outcome)  # observe
        for s, i in enumerate(rows.active):
            record = StepRecord(ks[s], accepted[s], rows.ends[i] - ends[s],
                                parts.drafters[decision.drafters[s]].name if ks[s] else "plain", draft_ms, verify_ms,
                                decision.alphas[s], decision.predicted_goodput, row=i, step=step,
                                predicted_ms=predicted_ms, decided=not rest)
            stats.steps.append(record)
            _stream(settings, rows.ids[i, ends[s] : rows.ends[i]], record)
        emitted = min(rows.ends[i] - ends[s] for s, i in enumerate(rows.active))
        last = _account(parts.controller, settings, last, (not rest, predicted_ms), emitted, not any(ks) and not tried)
        _leave(parts, rows, finished)
        step += 1
    if settings.streamer is not None:
        settings.streamer.end()
    stats.wall_ms = now()
    stats.row_tokens = tuple(end - input_ids.shape[1] for end in rows.ends)
    stats.finish_ms = tuple(rows.finish_ms)
    return DecodeResult(_pad_right(rows, settings.pad_token_id), stats)


def predicted_time(measured_ms: float, decided: bool, predicted_ms: float) -> float:
    """A step booked at its predicted time (ms; as measured where it was not predicted): decisions that
    depend on the costs and the learned state alone, not on the engine's timing."""
    return measured_ms if math.isnan(predicted_ms) else predicted_ms


def _account(controller: Controller, settings: DecodeSettings, last: float, how: tuple[bool, float], emitted: int,
             plain: bool) -> float:
    """Book the step that ran since ``last`` (perf_counter seconds) with the controller, as measured or as
    ``settings.step_ms`` prices it (``how``: whether it was decided, its predicted ms); returns the new mark."""
    mark = time.perf_counter()
    elapsed_ms = (mark - last) * 1000.0
    controller.account(elapsed_ms if settings.step_ms is None else settings.step_ms(elapsed_ms, *how), emitted,
                       plain, how[1])
    return mark


def _set_threads(chooser: ThreadChooser | None, explore: bool) -> int | None:
    """Set torch's thread count for the next step as ``chooser`` picks it (trying another count only where
    ``explore``; None: no chooser, left as set)."""
    if chooser is None:
        return None
    count = chooser.pick(explore)
    if count != torch.get_num_threads():
        torch.set_num_threads(count)
    return count


def _stream(settings: DecodeSettings, tokens: torch.Tensor, record: StepRecord | None) -> None:
    """Hand newly emitted tokens [m] to the streamer and the step callback (batch size 1 only; record
    None: the prefill's token)."""
    if settings.streamer is not None and tokens.numel():
        settings.streamer.put(tokens[None].cpu())
    if settings.on_step is not None:
        settings.on_step(record, tokens.cpu())


def _pad_right(rows: TokenRows, pad_token_id: int) -> torch.Tensor:
    """The rows' padded views, right-padded with pad_token_id to the longest → [B, max end]."""
    width = max(rows.ends)
    out = rows.ids[:, :width].clone()
    for i, end in enumerate(rows.ends):
        out[i, end:] = pad_token_id
    return out
