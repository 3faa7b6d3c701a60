"""Export a measured cost profile and traced acceptance as vLLM's ``speculative_config``.

Design: pure functions. ``acceptance_from_traces`` estimates the per-token acceptance α of a draft model
(the traced draft argmax vs the target's greedy token) and of n-gram prompt lookup (the lookup's
continuation vs the target's tokens) from greedy traces (``trace``). ``best_k`` is the proposal length
of highest goodput (SmartSpec, arXiv 2406.14066: tokens per unit time, ``policy.goodput.goodput``). The
export runs it at every batch size the profile measured, with the profile's target and draft costs,
merges consecutive batch sizes of equal k into ranges, and writes them with vLLM's documented keys.
An EAGLE-3 head ("eagle3") is priced by a profile measured with it (``hf-adaspec profile --head``) and by
its traced chains (``hf-adaspec trace --head``): its acceptance falls with depth (from the second token on
it drafts from its own outputs), so E(k) = 1 + Σ_{j≤k} P_j uses the measured P_j
(``head_prefix_acceptance``) instead of α^j.

vLLM's keys (``SpeculativeConfig``, vllm/config/speculative.py in vllm-project/vllm at commit
002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443; docs, read for v0.25.0 and latest):
- https://docs.vllm.ai/en/latest/features/speculative_decoding/draft_model/ ("method": "draft_model",
  "model", "num_speculative_tokens");
- https://docs.vllm.ai/en/latest/features/speculative_decoding/n_gram/ ("method": "ngram",
  "prompt_lookup_max", "prompt_lookup_min");
- https://docs.vllm.ai/en/latest/features/speculative_decoding/eagle/ ("method": "eagle3", "model": the
  head's path or HF id, "num_speculative_tokens");
- https://docs.vllm.ai/en/v0.25.0/features/speculative_decoding/dynamic_speculative_decoding/
  ("num_speculative_tokens_per_batch_size": [[start_bs, end_bs, K], ...], inclusive ranges, the first
  starting at 1, each K <= "num_speculative_tokens", which must be > 0; K = 0 drafts nothing). The V0
  key ``disable_by_batch_size`` is gone from V1's ``SpeculativeConfig``, so it is not written.

Caveat: the costs are the profiled stack's (transformers on the profiled machine), not vLLM's; the
export says what they imply. Provenance (α, profile key, context, predicted goodput per batch size) goes
under the separate top-level key "hf_adaspec", never inside ``speculative_config``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from ..costs.profile import Profile
from ..policy.goodput import expected_tokens_prefix, goodput, step_time_ms
from ..proposers.prompt_lookup import find_continuation
from .trace import Trace

METHODS = ("draft_model", "ngram", "eagle3")
NGRAM_MAX, NGRAM_MIN, LOOKUP_K = 3, 1, 8  # the lookup measured here, exported as prompt_lookup_max/min
DOCS = "https://docs.vllm.ai/en/v0.25.0/features/speculative_decoding/dynamic_speculative_decoding/"


def _draft_counts(trace: Trace) -> tuple[int, int]:
    """(agreements, positions): draft_next[j] == tokens[prompt_len + j] for j = 1..n-1."""
    agree = trace.draft_agreement()
    return sum(agree), len(agree)


def _lookup_counts(trace: Trace) -> tuple[int, int]:
    """(successes, failures) of prompt lookup at positions prompt_len + j, j = 1..n-1: each matched token
    of the continuation is a success, the first mismatch a failure; no continuation counts as one failure
    (that row's step yields only the target's token, as if its first draft were rejected)."""
    tokens = torch.tensor(trace.tokens, dtype=torch.long)
    hits = misses = 0
    for pos in range(trace.prompt_len + 1, len(trace.tokens)):
        found = find_continuation(tokens[:pos], NGRAM_MAX, NGRAM_MIN, LOOKUP_K).tolist()
        if not found:
            misses += 1
            continue
        for i, tok in enumerate(found[: len(trace.tokens) - pos]):
            if tok != trace.tokens[pos + i]:
                misses += 1
                break
            hits += 1
    return hits, misses


def acceptance_from_traces(traces: Sequence[Trace]) -> dict[str, float]:
    """Per-token acceptance α in [0, 1], pooled over all traces' positions (token-weighted).

    "draft_model": fraction of generated positions j = 1..n-1 where the traced draft argmax
    ``draft_next[j]`` equals the target's token ``tokens[prompt_len + j]`` (traces without a draft are
    skipped); "ngram": successes / (successes + failures) of ``find_continuation(tokens[:pos], 3, 1, 8)``
    (geometric trials, ``_lookup_counts``); "eagle3": a draft head's first-token agreement (P_1 of
    ``head_prefix_acceptance``). A method with no trials is left out.
    """
    agree = seen = hits = misses = 0
    for t in traces:
        a, s = _draft_counts(t)
        h, m = _lookup_counts(t)
        agree, seen, hits, misses = agree + a, seen + s, hits + h, misses + m
    out = {}
    if seen:
        out["draft_model"] = agree / seen
    if hits + misses:
        out["ngram"] = hits / (hits + misses)
    prefix = head_prefix_acceptance(traces)
    if prefix:
        out["eagle3"] = prefix[0]
    return out


def head_prefix_acceptance(traces: Sequence[Trace]) -> tuple[float, ...]:
    """P_1..P_D of a draft head (D: the shallowest traced chain depth): P_j = among generated positions with
    at least j tokens after them, the share whose head chain's first j tokens all equal the target's
    (``Trace.head_runs``), pooled over the traces that hold a head's chains; () when none does."""
    heads = [t for t in traces if t.head]
    if not heads:
        return ()
    depth = min(t.head_depth for t in heads)
    hits, seen = [0] * depth, [0] * depth
    for t in heads:
        for j, run in enumerate(t.head_runs(), start=1):
            for d in range(min(depth, t.new_tokens - j)):
                seen[d] += 1
                hits[d] += run > d
    return tuple(h / s for h, s in zip(hits, seen, strict=True) if s)


def best_k(alpha: float, draft_ms: float, verify_ms_of_n: Callable[[int], float], k_max: int) -> int:
    """The proposal length k in 0..k_max of highest goodput (tokens/s; ``policy.goodput.goodput``, SmartSpec
    arXiv 2406.14066): E[tokens | k, α] / (k·draft_ms + verify_ms_of_n(k + 1)), costs in ms. Ties keep the
    smaller k, so 0 (a plain step) unless some k > 0 beats it strictly."""
    if k_max < 0:
        raise ValueError(f"k_max must be >= 0, got {k_max}")
    rates = [goodput(alpha, k, draft_ms, verify_ms_of_n) for k in range(k_max + 1)]
    return max(range(k_max + 1), key=lambda k: (rates[k], -k))


def _ranges(ks: Sequence[tuple[int, int]]) -> list[list[int]]:
    """[[first, last, k], ...]: consecutive (batch size, k) pairs of equal k merged (measured sizes)."""
    out: list[list[int]] = []
    for b, k in ks:
        if out and out[-1][2] == k:
            out[-1][1] = b
        else:
            out.append([b, b, k])
    return out


def _schedule(ranges: Sequence[Sequence[int]]) -> list[list[int]]:
    """vLLM's [[start_bs, end_bs, K], ...]: the first range starts at 1 and each runs up to the next
    range's first measured size − 1 (the smaller size's k, as vLLM fills gaps); vLLM keeps the last K above."""
    starts = [1] + [r[0] for r in ranges[1:]]
    ends = [s - 1 for s in starts[1:]] + [ranges[-1][1]]
    return [[s, e, r[2]] for s, e, r in zip(starts, ends, ranges, strict=True)]


def _range_info(rng: Sequence[int], per_size: dict[int, tuple[float, float]]) -> dict:
    """One merged range for "hf_adaspec": its measured batch sizes, k, and per size the predicted goodput at
    k and of plain decoding (tokens/s over the batch)."""
    sizes = [b for b in sorted(per_size) if rng[0] <= b <= rng[1]]
    return {
        "batch_sizes": sizes,
        "num_speculative_tokens": rng[2],
        "predicted_goodput_tokens_per_s": [round(per_size[b][0], 2) for b in sizes],
        "plain_tokens_per_s": [round(per_size[b][1], 2) for b in sizes],
    }


def _check(
    profile: Profile, alphas: dict[str, float], method: str, model_name: str | None, head_prefix: Sequence[float]
) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}: this export supports {', '.join(METHODS)}")
    if method in ("draft_model", "eagle3") and not model_name:
        raise ValueError(
            f"method {method!r} needs the {'head' if method == 'eagle3' else 'draft model'}'s "
            "name or path (vLLM's 'model' key)"
        )
    if method in ("draft_model", "eagle3") and not profile.draft_cells:
        raise ValueError(
            f"profile {profile.key} has no draft cells; measure one with a draft model "
            "(`hf-adaspec profile`) or a head (`--head FOLDER`), or export --method ngram"
        )
    if method == "eagle3" and not profile.drafter_is_head:
        raise ValueError(
            f"profile {profile.key} was measured with a draft model; eagle3 needs the head's costs: "
            "`hf-adaspec profile --head FOLDER`"
        )
    if method == "draft_model" and profile.drafter_is_head:
        raise ValueError(
            f"profile {profile.key} was measured with a head; draft_model needs the draft model's "
            "costs (`hf-adaspec profile --draft ...`), or export --method eagle3"
        )
    if method == "eagle3" and not head_prefix:
        raise ValueError("no head chains in the traces; record them with `hf-adaspec trace --head FOLDER`")
    if method not in alphas:
        raise ValueError(f"no acceptance measured for {method!r} in the traces (have: {sorted(alphas)})")


def _rate(
    method: str, alpha: float, head_prefix: Sequence[float], k: int, draft: float, verify: Callable[[int], float]
) -> float:
    """Predicted goodput (tokens/s) at k: α^j acceptance, or a head's measured P_j (eagle3)."""
    if method != "eagle3":
        return goodput(alpha, k, draft, verify)
    return 1000.0 * expected_tokens_prefix(head_prefix[:k]) / step_time_ms(k, draft, verify)


def speculative_config(
    profile: Profile,
    alphas: dict[str, float],
    method: str,
    draft_name: str | None,
    context: int,
    k_max: int = 8,
    head_prefix: Sequence[float] = (),
) -> dict:
    """The export document: {"speculative_config": vLLM's config or None, "hf_adaspec": provenance}.

    Per measured batch size b (the profile's target cells): k_b, the k in 0..k_max of highest goodput (ties
    keep the smaller) with α = alphas[method] (eagle3: E(k) from ``head_prefix`` P_1..P_D, k ≤ D), draft cost
    ``profile.draft_ms(b, context)`` ms (0 for ngram; the head's for eagle3) and ``profile.verify_ms(b,
    context, n)`` ms at ``context`` tokens. vLLM's config: method, model (``draft_name``: the draft model or,
    for eagle3, the head's path or HF id), prompt_lookup_max/min (ngram), num_speculative_tokens = max_b
    k_b (k at batch 1 when k falls with b; vLLM needs it > 0 and >= every K) and, when k varies,
    num_speculative_tokens_per_batch_size (vLLM docs: ``DOCS``). None when k_b = 0 at every batch size
    (speculation does not pay). Predicted goodput is tokens/s over the batch (b rows).

    Raises:
        ValueError: unknown method; draft_model or eagle3 without a model name, without drafter cells or with
            the other drafter's profile; eagle3 without head chains; no α for the method.
    """
    _check(profile, alphas, method, draft_name, head_prefix)
    alpha = alphas[method]
    limit = min(k_max, len(head_prefix)) if method == "eagle3" else k_max
    sizes = sorted({c.batch for c in profile.target_cells})
    ks, per_size = [], {}
    for b in sizes:
        draft = profile.draft_ms(b, context) if method != "ngram" else 0.0
        verify = functools.partial(profile.verify_ms, b, context)  # verify(n): ms over n new tokens
        rates = [_rate(method, alpha, head_prefix, k, draft, verify) for k in range(limit + 1)]
        k = max(range(limit + 1), key=lambda i: (rates[i], -i))
        ks.append((b, k))
        per_size[b] = (b * rates[k], b * rates[0])
    ranges = _ranges(ks)
    info = {
        "alpha": alpha,
        "method": method,
        "profile": profile.key,
        "pair": profile.pair,
        "context": context,
        "k_max": k_max,
        "vllm_docs": DOCS,
        "per_batch_size": [_range_info(r, per_size) for r in ranges],
    }
    if method == "eagle3":
        info["prefix_acceptance"] = [round(p, 4) for p in head_prefix]
    top = max(k for _, k in ks)
    if top == 0:
        return {"speculative_config": None, "hf_adaspec": info}
    config: dict = {"method": method, "num_speculative_tokens": top}
    if method != "ngram":
        config["model"] = draft_name
    else:
        config.update(prompt_lookup_max=NGRAM_MAX, prompt_lookup_min=NGRAM_MIN)
    if len(ranges) > 1:
        config["num_speculative_tokens_per_batch_size"] = _schedule(ranges)
    return {"speculative_config": config, "hf_adaspec": info}
