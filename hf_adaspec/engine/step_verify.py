"""A step's verification, over every active row at once: the block the target reads (each row's last token and
its proposal, right-padded), the scores it verifies against (processors once over ``[b, K+1, V]`` where they read
only the scores), and the verification itself (greedy: every row in one call and one host read; sampling: the rows
of one k_i together, lossless per row: Leviathan et al. 2023, Alg. 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backend.ragged import right_pad
from ..kernels.argmax import argmax
from ..proposers.base import Proposal, Proposals
from .rows import TokenRows
from .settings import DecodeSettings
from .verification import Verification, greedy_verify, process_scores, speculative_sample


def verify_group(proposals: Sequence[Proposal], scores: torch.Tensor, settings: DecodeSettings) -> Verification:
    """Speculative-sampling verification of g rows' ``proposals`` of one length k against their processed
    scores [g, k+1, V], in one call on the CPU, where its generator is (a deterministic drafter's q is one-hot on
    its tokens)."""
    draft = torch.cat([proposal.tokens for proposal in proposals])  # [g, k]
    p = torch.softmax(scores.cpu(), dim=-1)  # [g, k+1, V]
    q = torch.cat(
        [
            torch.nn.functional.one_hot(proposal.tokens, p.shape[-1]).to(p.dtype)
            if proposal.q is None
            else proposal.q.cpu()
            for proposal in proposals
        ]
    )  # [g, k, V]
    return speculative_sample(draft, q, p, settings.generator)


def block_of(rows: TokenRows, proposals: Proposals, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor | None]:
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


def processed_scores(
    logits: torch.Tensor, proposals: Proposals, rows: TokenRows, settings: DecodeSettings, free: bool
) -> torch.Tensor:
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
    done = [
        process_scores(processor, rows.view(i)[None], p.tokens, logits[s : s + 1, : p.k + 1])  # [1, k_s+1, V]
        for s, (i, p) in enumerate(zip(rows.active, proposals, strict=True))
    ]
    return torch.cat([torch.nn.functional.pad(d, (0, 0, 0, width - d.shape[1])) for d in done])  # [b, K+1, V]


def verify_step(
    logits: torch.Tensor, proposals: Proposals, rows: TokenRows, settings: DecodeSettings, free: bool
) -> tuple[list[int], list[list[int]]]:
    """Verify every row's proposal against its logits (``logits`` [b, K+1, V] on the target's device) → accepted
    n_i and the new tokens [n_i + 1] (ids on the host). Greedy: all rows in one call, one host read; sampling:
    the rows of one k_i in one call (``verify_group``), one host read per group."""
    if not settings.do_sample and not proposals.tokens.numel():  # greedy plain rows: the target's argmax
        scores = processed_scores(logits[:, :1], proposals, rows, settings, free)  # [b, 1, V]
        return [0] * len(proposals), [[t] for t in argmax(scores[:, 0]).tolist()]
    drafts = proposals.rows()  # the proposals are on the host
    width = max(len(d) for d in drafts) + 1
    scores = processed_scores(logits[:, :width], proposals, rows, settings, free)  # [b, K+1, V]
    if not settings.do_sample:
        accepted, tokens = greedy_verify(drafts, scores)  # one host read
    else:
        accepted, tokens = [0] * len(proposals), [0] * len(proposals)
        for k in sorted(set(proposals.ks)):
            group = [s for s, n in enumerate(proposals.ks) if n == k]
            result = verify_group([proposals[s] for s in group], scores[group, : k + 1], settings)
            both = torch.cat([result.num_accepted, result.next_token]).tolist()  # one transfer per group
            for j, s in enumerate(group):
                accepted[s], tokens[s] = both[j], both[len(group) + j]
    return accepted, [d[:n] + [t] for d, n, t in zip(drafts, accepted, tokens, strict=True)]
