"""Replay: the library's own controllers, through the engine, on traces, timed by a virtual clock.

Design: a request is assembled by the same ``engine.run.build_run`` that ``generate`` uses (the mode
registry's drafters and controller; the draft model's and the target's caches answer from the traces,
``virtual.TraceCaches``), run by the real ``speculative_decode`` loop, and what it taught the pair is kept
by the same ``record_run``; learned state (``SpeculationState``) carries from request to request as in a
bench. The
output must equal the trace (checked). Time is not measured but priced: each logged forward by the cost
profile (target: verification of n tokens at b rows and context c; draft: one token, plus catch-up
columns), the prefill by the trace, plus a fixed per-step overhead of the engine (and per token of
transformers' plain loop). Plain decoding is priced the same way, so speedups are ratios on one clock.
The oracle (``oracle.oracle_schedule``) prices the best schedule over the same drafters and costs.
A replay's figures are predictions (a projection when the profile is another machine's).

A draft head is replayed the same way: on traces with the head's chains (``hf-adaspec trace --head``) the
mode registry builds the real ``DraftHeadProposer`` on a ``virtual.VirtualHead``, priced by a profile
measured with the head (``hf-adaspec profile --head``: its drafter cells are the head's); "fixed-head"
and "adaptive-head" are "fixed-k" and "adaptive" with the head in the draft model's place.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import torch
from transformers import LogitsProcessorList

from ..backend.ragged import left_pad
from ..bench.bench import method_kwargs
from ..bench.oracle import OracleDrafter, agreement_runs, oracle_schedule
from ..bench.oracle_inputs import costless_runs
from ..config import SpeculationConfig
from ..costs.table import CostTable
from ..engine.loop import speculative_decode
from ..engine.run import SpeculationState, build_run, record_run
from ..engine.settings import DecodeSettings
from ..engine.stats import SpeculationStats
from .clock import Clock, StepPrices, price_request
from .trace import Trace
from .virtual import Forward, TraceCaches, VirtualHead, Vocab, draft_answers, head_answers, target_answers

REPLAY_METHODS = ("plain", "fixed-k", "pmin", "adaptive", "adaptive-lookup", "fixed-head", "adaptive-head")
HEAD_METHODS = ("fixed-head", "adaptive-head")
HEAD_FAMILY = {"fixed-head": "head", "adaptive-head": "head-hybrid"}  # the oracle family bounding each
K_MAX = 8
FIXED_K = 5  # "fixed-k" and "fixed-head"'s proposal length


class VirtualDraft:
    """Stands in for the draft model where the learned state keys drafters by model identity."""


@dataclass(frozen=True)
class ReplayRun:
    """One replayed request (B rows): predicted time (ms), tokens, decisions, and whether the output
    equals the traces (it must)."""

    question_ids: tuple[int, ...]
    categories: tuple[str, ...]
    method: str
    new_tokens: int
    time_ms: float
    steps: int
    mean_accepted_length: float | None
    acceptance: float | None
    mean_k: float | None
    plain_share: float | None
    k_histogram: dict[int, int] = field(default_factory=dict)
    drafter_histogram: dict[str, int] = field(default_factory=dict)
    draft_prefix_tokens: int = 0
    matches_trace: bool = True
    stats: SpeculationStats | None = field(default=None, repr=False, compare=False)  # every step (None: plain)

    def summary(self) -> dict:
        """The run as JSON values, without the per-step stats."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stats"}

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.new_tokens / self.time_ms


def plain_run(traces: Sequence[Trace], clock: Clock) -> ReplayRun:
    """Plain (batched) greedy decoding: the prefill, then one 1-token forward per step for every row until
    the longest row ends (as transformers' ``generate`` keeps finished rows); or, with ``clock.plain`` "trace",
    the trace's own timing of it (``Clock.traced_plain_ms``, which raises ValueError where it cannot)."""
    b, width = len(traces), max(t.prompt_len for t in traces)
    steps = max(t.new_tokens for t in traces) - 1
    if clock.plain == "trace":
        ms = clock.traced_plain_ms(traces)
    else:
        ms = clock.prefill_ms(traces) + sum(
            clock.verify_ms(Forward(b, 1, width + s)) + clock.plain_overhead_ms for s in range(1, steps + 1)
        )
    return ReplayRun(
        tuple(t.question_id for t in traces),
        tuple(t.category for t in traces),
        "plain",
        sum(t.new_tokens for t in traces),
        ms,
        steps,
        1.0,
        None,
        0.0,
        1.0,
        {0: steps},
        {"plain": steps},
    )


def _stopping(eos: torch.Tensor, max_length: int) -> Callable[[torch.Tensor, object], torch.Tensor]:
    """Stop a row ([1, T] ids) at ``max_length`` tokens or on an EOS id."""
    return lambda ids, scores: torch.tensor([ids.shape[1] >= max_length or bool(torch.isin(ids[0, -1], eos))])


def check_head_method(method: str, traces: Sequence[Trace], clock: Clock) -> None:
    """Raise ValueError naming the fix when head ``method`` cannot be replayed: traces without the head's
    chains, or a clock without head costs."""
    if method not in HEAD_METHODS:
        return
    if not all(t.head for t in traces):
        raise ValueError(
            f"{method} needs traces with a draft head's chains; add them with `hf-adaspec trace "
            "--head FOLDER` (the traced prompts are not generated again)"
        )
    if clock.head_profile is None:
        raise ValueError(
            f"{method} needs the head's costs: pass --head-profile, a profile measured by "
            "`hf-adaspec profile --head FOLDER` for the same target"
        )


def _method_kwargs(method: str, head: VirtualHead) -> dict:
    """generate()'s keywords for a replayed method, with ``head`` or the draft's stand-in as assistant."""
    if method == "adaptive-head":
        return {"assistant_model": head, "speculation": "adaptive"}
    if method == "fixed-head":
        return {"assistant_model": head, "speculation": "fixed", "num_speculative_tokens": FIXED_K}
    return method_kwargs(method, VirtualDraft, FIXED_K)


def replay_request(
    traces: Sequence[Trace],
    method: str,
    state: SpeculationState,
    clock: Clock,
    costs_for: Callable[[int, int], CostTable] | None = None,
    head: VirtualHead | None = None,
) -> ReplayRun:
    """Replay ``method`` on a static batch of the traces' prompts (B = len(traces)), learning into ``state``.

    costs_for(b, context) → the controller's ``CostTable`` (default: the clock's profile at the padded
    prompt length, as the engine uses a profile; the head profile for a head method). ``head``: the head's
    stand-in, one per replayed method so its learned calibration carries (default: a new one). Raises
    ValueError for an unknown method, a draft method on traces taken without a draft, or a head method
    without head chains or head costs (``check_head_method``)."""
    if method == "plain":
        return plain_run(traces, clock)
    if method not in REPLAY_METHODS:
        raise ValueError(f"unknown replay method {method!r}; choose from {REPLAY_METHODS}")
    check_head_method(method, traces, clock)
    head = head if head is not None else VirtualHead()
    kwargs = _method_kwargs(method, head)
    config = SpeculationConfig(**{k: v for k, v in kwargs.items() if k != "assistant_model"})
    draft_key = kwargs.get("assistant_model")
    drafts = draft_key is VirtualDraft
    if drafts and not all(t.draft for t in traces):
        raise ValueError(f"{method} needs traces taken with a draft model; re-run `hf-adaspec trace --draft ...`")
    drafting_head = head if draft_key is head else None
    chains = [i for t in traces for row in t.head_next for i in row] if drafting_head is not None else []
    vocab = Vocab([i for t in traces for i in (*t.tokens, *t.draft_next, *t.eos)] + chains + state.suffixes.ids())
    eos = vocab.encode(traces[0].eos)
    pad = int(eos[0]) if eos.numel() else 0  # pads fill holes the engine never reads
    rows = [vocab.encode(t.tokens) for t in traces]
    input_ids, valid = left_pad([r[: t.prompt_len] for r, t in zip(rows, traces, strict=True)], pad)  # [B, T]
    width = input_ids.shape[1]
    caches = _trace_caches(traces, rows, vocab, pad, drafts, drafting_head)
    settings = _settings(clock, caches, eos, pad, width + max(t.max_new_tokens for t in traces), drafting_head)
    priced_by = clock.head_profile if drafting_head is not None else clock.profile
    table = costs_for or (lambda b, c: priced_by.cost_table(b, c, config.max_speculative_tokens + 1))
    run = build_run(
        config,
        _in_request_ids(state, vocab),
        input_ids,
        valid.long(),
        draft_key,
        caches,
        functools.cache(lambda b: table(b, width)),
        settings,
    )
    result = speculative_decode(run.parts, input_ids, valid.long())
    outputs = [vocab.decode(result.sequences[i, width : width + n]) for i, n in enumerate(result.stats.row_tokens)]
    record_run(state, run, [list(t.tokens[: t.prompt_len]) for t in traces], outputs)
    draft_log = caches.made_draft.log if caches.made_draft is not None else []
    head_log = drafting_head.log if drafting_head is not None else []
    time_ms = price_request(clock, traces, caches.made_target.log, (draft_log, head_log), result.stats)
    seed = run.seed.length if run.seed is not None else 0
    return _run(traces, method, result.stats, time_ms, seed, _matches(result.sequences, width, traces, vocab))


def _trace_caches(
    traces: Sequence[Trace], rows: list[torch.Tensor], vocab: Vocab, pad: int, drafts: bool, head: VirtualHead | None
) -> TraceCaches:
    """The target's answers (and the draft's, where ``drafts``; the head's, served to ``head``) from the traces,
    in this request's ids."""
    caches = TraceCaches(
        [target_answers(r, pad) for r in rows],
        [draft_answers(t.prompt_len, vocab.encode(t.draft_next), t.draft_q) for t in traces] if drafts else [],
        vocab.size,
        head,
    )
    if head is not None:
        chains = [vocab.encode([i for row in t.head_next for i in row]).view(len(t.head_next), -1) for t in traces]
        head.serve([head_answers(t.prompt_len, c, t.head_q) for t, c in zip(traces, chains, strict=True)], vocab.size)
    return caches


def _settings(
    clock: Clock, caches: TraceCaches, eos: torch.Tensor, pad: int, max_length: int, head: VirtualHead | None
) -> DecodeSettings:
    """Greedy decoding to ``max_length`` or an EOS id, each step priced by the clock (``StepPrices``)."""
    return DecodeSettings(
        LogitsProcessorList(),
        _stopping(eos, max_length),
        max_length,
        False,
        pad,
        tuple(eos.tolist()),
        decision_ms=clock.decision_ms,
        step_ms=StepPrices(clock, caches, head),
    )


def _in_request_ids(state: SpeculationState, vocab: Vocab) -> SpeculationState:
    """``state`` with its suffix index and draft prefixes in this request's ids."""
    return dataclasses.replace(
        state,
        suffixes=state.suffixes.mapped(lambda s: vocab.encode(s.tolist()).numpy()),
        draft_prefixes=state.draft_prefixes.mapped(vocab.encode_known),
    )


def _matches(sequences: torch.Tensor, width: int, traces: Sequence[Trace], vocab: Vocab) -> bool:
    """Each row's generated ids equal its trace's output."""
    for seq, t in zip(sequences, traces, strict=True):
        got = vocab.decode(seq[width : width + t.new_tokens])
        if got != list(t.tokens[t.prompt_len :]):
            return False
    return True


def _run(
    traces: Sequence[Trace], method: str, stats: SpeculationStats, time_ms: float, seed: int, same: bool
) -> ReplayRun:
    drafters: dict[str, int] = {}
    for s in stats.steps:
        drafters[s.drafter] = drafters.get(s.drafter, 0) + 1
    acceptance = stats.acceptance_rate
    return ReplayRun(
        tuple(t.question_id for t in traces),
        tuple(t.category for t in traces),
        method,
        sum(stats.row_tokens),
        time_ms,
        len({s.step for s in stats.steps}),
        stats.mean_accepted_length,
        None if math.isnan(acceptance) else acceptance,
        stats.mean_k,
        stats.plain_share,
        dict(sorted(stats.k_histogram.items())),
        drafters,
        seed,
        same,
        stats,
    )


def oracle_tokens_per_s(trace: Trace, clock: Clock, seed: int, k_max: int = K_MAX) -> dict[str, float]:
    """Oracle tokens/s per drafter family ("draft", "lookup": the costless drafters, "hybrid": both; with a
    head's chains in the trace and head costs on the clock also "head", "head-hybrid": the head and the
    costless drafters, and "all": every drafter) for one trace: the fastest schedule knowing every
    acceptance (the head's: its traced chains, ``Trace.head_runs``), each step priced as the clock prices it
    (at the mid-output context, the step overhead included), the prefill and the drafters' catch-up of the
    prompt (the draft's less ``seed``) added."""
    n, mid = trace.new_tokens, trace.prompt_len + trace.new_tokens // 2
    seq = torch.tensor([trace.tokens])
    lookup = OracleDrafter(tuple(costless_runs(seq, trace.prompt_len, k_max)))
    verify = lambda cols: clock.verify_ms(Forward(1, cols, mid)) + clock.step_overhead_ms  # noqa: E731
    families: dict[str, list[OracleDrafter]] = {"lookup": [lookup]}
    model = head = None
    if trace.draft:
        model = OracleDrafter(
            tuple(agreement_runs(trace.draft_agreement())),
            clock.draft_ms(Forward(1, 1, mid)),
            clock.draft_ms(Forward(1, trace.prompt_len - seed, 0)) if trace.prompt_len > seed else 0.0,
        )
        families.update(draft=[model], hybrid=[model, lookup])
    if trace.head and clock.head_profile is not None:
        head = OracleDrafter(
            tuple(trace.head_runs()), clock.head_ms(Forward(1, 1, mid)), clock.head_ms(Forward(1, trace.prompt_len, 0))
        )
        families.update({"head": [head], "head-hybrid": [head, lookup]})
    if model is not None and head is not None:
        families["all"] = [model, head, lookup]
    prefill = clock.prefill_ms([trace])
    return {f: 1000.0 * n / (prefill + oracle_schedule(d, k_max, verify).time_ms) for f, d in families.items()}
