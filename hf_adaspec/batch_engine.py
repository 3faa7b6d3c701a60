"""The speculative loop for a static, left-padded batch with per-request proposal lengths.

Each step the controller picks a drafter and k_i per active row; each drafter proposes at once for the
rows that picked it (a confidence controller may end drafting early and cut the proposals' tails); the
target verifies every row's [last token, d_1..d_{k_i}] in one forward (right-padded to k+1 columns);
each row accepts its own n_i (ragged acceptance) plus a bonus/correction token; target and draft
caches roll back per row by masking (``RaggedCache``). Rows that stop (EOS, max_new_tokens, a stopping
criterion) leave the batch, so later steps run on fewer rows. Invariant: the target cache holds every
token of a row but its last. Greedy rows equal their batch-1 plain greedy output where the forward is
shape-stable; sampling is lossless per row (the same verification as the batch-1 engine).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .batch_confidence import BatchConfidenceController
from .batch_controller import BatchFixedController, BatchGoodputController
from .engine import DecodeSettings, append_tokens, process_scores, select_token, verify_proposal
from .proposers.base import Proposal
from .proposers.batch_base import BatchProposer, BatchRows
from .ragged import RaggedCache, right_pad
from .stats import BatchSpeculationStats, BatchStepRecord


@dataclass(frozen=True)
class BatchDecodeResult:
    """sequences: [B, T + new] long (left-padded prompts, rows right-padded with pad_token_id)."""

    sequences: torch.Tensor
    stats: BatchSpeculationStats


@dataclass
class _Rows:
    """Mutable per-request state: padded views [T_i], padding lengths, finished flags and times."""

    views: list[torch.Tensor]
    starts: list[int]
    active: list[int]
    finish_ms: list[float]

    def batch_rows(self) -> BatchRows:
        return BatchRows(tuple(self.views[i] for i in self.active), tuple(self.starts[i] for i in self.active))


def _emit(rows: _Rows, slot: int, new: torch.Tensor, settings: DecodeSettings, now_ms: float) -> bool:
    """Append new tokens [1, m] to active row ``slot``; True when it stopped."""
    i = rows.active[slot]
    view, done = append_tokens(rows.views[i][None], new, settings)
    rows.views[i] = view[0]
    if done:
        rows.finish_ms[i] = now_ms
        return True
    return False


def _verify_rows(logits, proposals, rows: _Rows, settings: DecodeSettings) -> tuple[list[int], list[torch.Tensor]]:
    """Per row verify its proposal against its logits [1, k_i+1, V] → accepted n_i, new tokens [1, n_i+1]."""
    accepted, new = [], []
    for slot, (i, proposal) in enumerate(zip(rows.active, proposals, strict=True)):
        row_logits = logits[slot : slot + 1, : proposal.k + 1].cpu()  # [1, k_i+1, V]
        scores = process_scores(settings.logits_processor, rows.views[i][None], proposal.tokens, row_logits)
        result = verify_proposal(proposal, scores, settings)
        n = int(result.num_accepted[0])
        accepted.append(n)
        new.append(torch.cat([proposal.tokens[:, :n], result.next_token[:, None]], dim=1))
    return accepted, new


def _decide(rows: _Rows, proposers, controller, settings: DecodeSettings, prompt_width: int):
    """The controller's BatchDecision for the active rows: what each drafter offers each row (capped by
    the row's budget), the drafters' catch-up, and the horizon (tokens per row still to come,
    ``settings.horizon`` of the shortest row and the smallest budget)."""
    current = rows.batch_rows()
    budget = [settings.max_length - rows.views[i].shape[0] - 1 for i in rows.active]
    uppers = [[max(0, min(b, u)) for b, u in zip(budget, p.available(current, settings.k_max), strict=True)]
              for p in proposers]  # [D][b]
    generated = min(rows.views[i].shape[0] for i in rows.active) - prompt_width
    horizon = settings.horizon(generated, min(budget) + 1)
    return controller.choose(uppers, [p.catchup_tokens(current) for p in proposers], horizon)


def _propose(proposers, current: BatchRows, decision, controller, greedy: bool) -> list[Proposal]:
    """Each row's proposal from its drafter (a drafter runs once for all rows that picked it), ended
    early by the controller's ``stop_rule`` and, when greedy, cut by its ``eliminate`` if it has them.
    Sampling skips elimination: its cut looks at tokens past the cut, and keeping a token only when its
    own q(x) is high would bias that position's distribution; the stop rule, which decides on the
    tokens drafted so far, keeps verification lossless."""
    start = time.perf_counter()
    stop_rule, eliminate = getattr(controller, "stop_rule", None), getattr(controller, "eliminate", None)
    stop = stop_rule(len(decision.ks)) if stop_rule is not None else None
    proposals = [Proposal(torch.zeros(1, 0, dtype=torch.long))] * len(decision.ks)
    for d, proposer in enumerate(proposers):
        ks = [k if drafter == d else 0 for k, drafter in zip(decision.ks, decision.drafters, strict=True)]
        if max(ks):
            for i, proposal in enumerate(proposer.propose(current, ks, stop=stop)):
                proposals[i] = proposal if decision.drafters[i] == d else proposals[i]
    if eliminate is None or not greedy or not max(p.k for p in proposals):
        return proposals
    return eliminate(proposals, decision.drafters, (time.perf_counter() - start) * 1000.0)


@torch.no_grad()
def speculative_decode_batch(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    proposers: Sequence[BatchProposer],
    controller: BatchGoodputController | BatchFixedController | BatchConfidenceController,
    settings: DecodeSettings,
    pad_token_id: int,
) -> BatchDecodeResult:
    """Generate for a left-padded batch. input_ids, attention_mask: [B, T] → BatchDecodeResult."""
    stats, start = BatchSpeculationStats(), time.perf_counter()
    batch = input_ids.shape[0]
    rows = _Rows(list(input_ids.cpu()), (attention_mask.shape[1] - attention_mask.sum(1)).tolist(),
                 list(range(batch)), [0.0] * batch)
    cache = RaggedCache(target, batch)
    logits = cache.append(input_ids, attention_mask.bool(), keep=1)[:, -1].cpu()  # [B, V]
    now = lambda: (time.perf_counter() - start) * 1000.0  # noqa: E731
    finished = [_emit(rows, i, select_token(settings.logits_processor(rows.views[i][None], logits[i : i + 1]),
                                            settings.do_sample, settings.generator), settings, now())
                for i in range(batch)]
    stats.prefill_ms = now()
    while True:
        keep = torch.tensor([s for s, f in enumerate(finished) if not f], dtype=torch.long)
        if keep.numel() < len(rows.active):
            rows.active = [rows.active[int(s)] for s in keep]
            for part in (cache, controller, *proposers):
                part.select(keep)
        if not rows.active:
            break
        decision = _decide(rows, proposers, controller, settings, input_ids.shape[1])
        t0 = time.perf_counter()
        current = rows.batch_rows()
        proposals = _propose(proposers, current, decision, controller, not settings.do_sample)
        t1 = time.perf_counter()
        last_and_drafts = [torch.cat([rows.views[i][-1:], p.tokens[0]]) for i, p in zip(rows.active, proposals)]
        block, valid = right_pad(last_and_drafts, pad_token_id)  # [b, k+1]
        logits = cache.append(block, valid, keep=block.shape[1])  # [b, k+1, V]
        accepted, new = _verify_rows(logits, proposals, rows, settings)
        confirmed = current.lengths + torch.tensor(accepted)  # tokens each row holds, minus its new last token
        cache.rollback(confirmed)
        for d, proposer in enumerate(proposers):  # a drafter keeps its own tokens only where they were accepted
            mine = torch.tensor([drafter == d for drafter in decision.drafters])
            proposer.rollback(torch.where(mine, confirmed, current.lengths))
        ks = tuple(p.k for p in proposals)
        controller.observe(decision.drafters, ks, accepted, [p.confidences for p in proposals])
        finished = [_emit(rows, s, n, settings, now()) for s, n in enumerate(new)]
        names = tuple(proposers[d].name if k else "plain" for d, k in zip(decision.drafters, ks, strict=True))
        stats.steps.append(BatchStepRecord(ks, tuple(accepted), (t1 - t0) * 1000.0,
                                           (time.perf_counter() - t1) * 1000.0, decision.predicted_goodput, names))
    stats.wall_ms = now()
    stats.new_tokens = tuple(int(v.shape[0]) - input_ids.shape[1] for v in rows.views)
    stats.finish_ms = tuple(rows.finish_ms)
    return BatchDecodeResult(_pad_right(rows.views, pad_token_id), stats)


def _pad_right(views: list[torch.Tensor], pad_token_id: int) -> torch.Tensor:
    """Stack rows of different lengths, right-padding with pad_token_id → [B, max len]."""
    width = max(v.shape[0] for v in views)
    out = torch.full((len(views), width), pad_token_id, dtype=torch.long)
    for i, v in enumerate(views):
        out[i, : v.shape[0]] = v
    return out
