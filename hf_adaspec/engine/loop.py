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

import time
from collections.abc import Callable, Sequence

import torch

from ..backend import hf_compat
from ..policy.controller import Controller, StepView
from ..policy.decision import Decision, StepOutcome
from ..proposers.base import DraftOffer, Proposals, Rows
from .hindsight import scored
from .rows import TokenRows
from .settings import DecodeResult, DecodeSettings, RunParts
from .stats import SpeculationStats, StepRecord
from .step_verify import block_of, verify_step
from .threads import ThreadChooser
from .verification import select_token


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


def _decide(
    rows: TokenRows, current: Callable[[], Rows], parts: RunParts
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


def _propose(
    parts: RunParts, current: Callable[[], Rows], offers: Sequence[DraftOffer], decision: Decision
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


def _commit(
    parts: RunParts,
    finished: list[bool],
    confirmed: torch.Tensor,
    own: Sequence[torch.Tensor],
    features: list[torch.Tensor] | None,
) -> None:
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


def _commit_step(
    parts: RunParts,
    decision: Decision,
    finished: list[bool],
    held: list[int],
    accepted: list[int],
    features: torch.Tensor | None,
) -> None:
    """``_commit`` after a step whose rows ``held`` tokens before it and ``accepted`` n_i of their drafts: the
    target keeps held + n_i per row, each drafter what ``_own`` says, the head's features of the n_i + 1
    confirmed positions. Where every row made a plain step, none finished and no features are recorded, this
    changes nothing (the target's cache holds every token but the last; no drafter ingested anything), so the
    loop does not call it then."""
    confirmed = torch.tensor([h + n for h, n in zip(held, accepted, strict=True)])  # [b]
    before = torch.tensor(held) if any(accepted) else confirmed  # [b]
    own = [_own(d, decision.drafters, confirmed, before) for d in range(len(parts.drafters))]
    kept = None if features is None else [features[s, : n + 1] for s, n in enumerate(accepted)]  # [n_i+1, F]
    _commit(parts, finished, confirmed, own, kept)


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


def _prefill(
    parts: RunParts, rows: TokenRows, input_ids: torch.Tensor, attention_mask: torch.Tensor, now: Callable[[], float]
) -> None:
    """The prompt's forward and each row's first token; rows that stopped at it leave, and drafters that read
    the target's features get the prompt's."""
    settings, batch = parts.settings, input_ids.shape[0]
    logits, features = parts.cache.append_features(input_ids, attention_mask.bool(), 1, parts.feature_layers)
    logits = logits[:, -1].cpu() if settings.do_sample else logits[:, -1]  # [B, V]; sampling on the CPU
    firsts = [
        int(
            select_token(
                settings.logits_processor(rows.view(i)[None].to(logits.device), logits[i : i + 1]),
                settings.do_sample,
                settings.generator,
            )
        )
        for i in range(batch)
    ]  # B ids
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
    rows = TokenRows.open(
        input_ids, attention_mask, settings.max_length, settings.stopping_criteria, settings.pad_token_id
    )
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
        block, valid = block_of(rows, proposals, settings.pad_token_id)  # [b, K+1]
        logits, features = parts.cache.append_features(block, valid, block.shape[1], parts.feature_layers)
        accepted, new = verify_step(logits, proposals, rows, settings, free)  # verify
        mark = time.perf_counter()
        seen = () if view is None else scored(offers, view, new)
        decision_ms = (
            (decision_s + time.perf_counter() - mark) * 1000.0 if settings.decision_ms is None else settings.decision_ms
        )
        held = [rows.ends[i] - rows.starts[i] for i in rows.active]  # tokens each row held before the step
        ends = [rows.ends[i] for i in rows.active]
        finished = [rows.emit(s, n, now()) for s, n in enumerate(new)]
        ks = proposals.ks
        if any(ks) or any(finished) or features is not None:  # a plain step's commit would change nothing
            _commit_step(parts, decision, finished, held, accepted, features)  # commit
        draft_ms, verify_ms = (t1 - t0) * 1000.0, (time.perf_counter() - t1) * 1000.0
        outcome = StepOutcome(
            decision.drafters, ks, tuple(accepted), proposals.confidences or ((),) * len(ks), seen, decision_ms
        )
        predicted_ms = decision.price(outcome)
        if threads is not None:
            settings.threads.observe(threads, draft_ms + verify_ms, predicted_ms)
        if not rest:
            parts.controller.observe(decision, outcome)  # observe
        for s, i in enumerate(rows.active):
            record = StepRecord(
                ks[s],
                accepted[s],
                rows.ends[i] - ends[s],
                parts.drafters[decision.drafters[s]].name if ks[s] else "plain",
                draft_ms,
                verify_ms,
                decision.alphas[s],
                decision.predicted_goodput,
                row=i,
                step=step,
                predicted_ms=predicted_ms,
                decided=not rest,
            )
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


def _account(
    controller: Controller, settings: DecodeSettings, last: float, how: tuple[bool, float], emitted: int, plain: bool
) -> float:
    """Book the step that ran since ``last`` (perf_counter seconds) with the controller, as measured or as
    ``settings.step_ms`` prices it (``how``: whether it was decided, its predicted ms); returns the new mark."""
    mark = time.perf_counter()
    elapsed_ms = (mark - last) * 1000.0
    controller.account(
        elapsed_ms if settings.step_ms is None else settings.step_ms(elapsed_ms, *how), emitted, plain, how[1]
    )
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
