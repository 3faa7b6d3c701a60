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
from ..config import SpeculationConfig
from ..costs.profile import Profile
from ..costs.table import CostTable
from ..engine.loop import DecodeSettings, speculative_decode
from ..engine.run import SpeculationState, build_run, record_run
from ..engine.stats import SpeculationStats
from .bench import method_kwargs
from .bench_oracle import costless_runs
from .oracle import OracleDrafter, agreement_runs, oracle_schedule
from .trace import Trace
from .virtual import Forward, TraceCaches, Vocab, draft_answers, target_answers

REPLAY_METHODS = ("plain", "fixed-k", "pmin", "adaptive", "adaptive-lookup")
K_MAX = 8
_CONTEXT_STEP = 8  # contexts are priced in buckets of 8 tokens (a cost barely moves within one), so prices cache well


class VirtualDraft:
    """Stands in for the draft model where the learned state keys drafters by model identity."""


class Clock:
    """Prices forwards (ms): a cost ``profile`` (the target's and the draft's cells), the engine's fixed
    ``step_overhead_ms`` per speculative step, and ``plain_overhead_ms`` per token of plain decoding."""

    def __init__(self, profile: Profile, step_overhead_ms: float = 0.0, plain_overhead_ms: float = 0.0) -> None:
        self.profile, self.step_overhead_ms, self.plain_overhead_ms = profile, step_overhead_ms, plain_overhead_ms
        self._cache: dict[tuple[bool, int, int, int], float] = {}

    def _priced(self, target: bool, f: Forward) -> float:
        key = (target, f.batch, max(1, f.context // _CONTEXT_STEP * _CONTEXT_STEP), f.columns)
        if key not in self._cache:
            _, b, c, n = key
            self._cache[key] = (self.profile.verify_ms(b, c, n) if target else
                                self.profile.draft_ms(b, c) + (n - 1) * self.profile.catchup_ms(b, c))
        return self._cache[key]

    def verify_ms(self, f: Forward) -> float:
        """A target forward over f.columns new tokens (ms)."""
        return self._priced(True, f)

    def draft_ms(self, f: Forward) -> float:
        """A draft forward: one token, plus (columns − 1) caught-up tokens (ms)."""
        return self._priced(False, f)


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
    the longest row ends (as transformers' ``generate`` keeps finished rows)."""
    b, width = len(traces), max(t.prompt_len for t in traces)
    steps = max(t.new_tokens for t in traces) - 1
    ms = sum(t.prefill_ms for t in traces) + sum(
        clock.verify_ms(Forward(b, 1, width + s)) + clock.plain_overhead_ms for s in range(1, steps + 1))
    return ReplayRun(tuple(t.question_id for t in traces), tuple(t.category for t in traces), "plain",
                     sum(t.new_tokens for t in traces), ms, steps, 1.0, None, 0.0, 1.0, {0: steps}, {"plain": steps})


def _stopping(eos: torch.Tensor, max_length: int) -> Callable[[torch.Tensor, object], torch.Tensor]:
    """Stop a row ([1, T] ids) at ``max_length`` tokens or on an EOS id."""
    return lambda ids, scores: torch.tensor([ids.shape[1] >= max_length or bool(torch.isin(ids[0, -1], eos))])


def replay_request(traces: Sequence[Trace], method: str, state: SpeculationState, clock: Clock,
                   costs_for: Callable[[int, int], CostTable] | None = None) -> ReplayRun:
    """Replay ``method`` on a static batch of the traces' prompts (B = len(traces)), learning into ``state``.

    costs_for(b, context) → the controller's ``CostTable`` (default: the clock's profile at the padded
    prompt length, as the engine uses a profile). Raises ValueError for an unknown method, or a draft
    method on traces taken without a draft."""
    if method == "plain":
        return plain_run(traces, clock)
    if method not in REPLAY_METHODS:
        raise ValueError(f"unknown replay method {method!r}; choose from {REPLAY_METHODS}")
    kwargs = method_kwargs(method, VirtualDraft, 5)
    config = SpeculationConfig(**{k: v for k, v in kwargs.items() if k != "assistant_model"})
    draft_key = kwargs.get("assistant_model")
    if draft_key is not None and not all(t.draft for t in traces):
        raise ValueError(f"{method} needs traces taken with a draft model; re-run `hf-adaspec trace --draft ...`")
    vocab = Vocab([i for t in traces for i in (*t.tokens, *t.draft_next, *t.eos)] + state.suffixes.ids())
    eos = vocab.encode(traces[0].eos)
    pad = int(eos[0]) if eos.numel() else 0  # pads fill holes the engine never reads
    rows = [vocab.encode(t.tokens) for t in traces]
    input_ids, valid = left_pad([r[: t.prompt_len] for r, t in zip(rows, traces, strict=True)], pad)  # [B, T]
    width = input_ids.shape[1]
    caches = TraceCaches([target_answers(r, pad) for r in rows],
                         [draft_answers(t.prompt_len, vocab.encode(t.draft_next), t.draft_q) for t in traces]
                         if draft_key is not None else [], vocab.size)
    max_length = width + max(t.max_new_tokens for t in traces)
    settings = DecodeSettings(LogitsProcessorList(), _stopping(eos, max_length), max_length, False, pad,
                              tuple(eos.tolist()))
    table = costs_for or (lambda b, c: clock.profile.cost_table(b, c, config.max_speculative_tokens + 1))
    compact = dataclasses.replace(state, suffixes=state.suffixes.mapped(lambda s: vocab.encode(s.tolist()).numpy()),
                                  draft_prefixes=state.draft_prefixes.mapped(vocab.encode_known))  # this request's ids
    run = build_run(config, compact, input_ids, valid.long(), draft_key, caches,
                    functools.cache(lambda b: table(b, width)), settings)
    result = speculative_decode(run.parts, input_ids, valid.long())
    outputs = [vocab.decode(result.sequences[i, width : width + n]) for i, n in enumerate(result.stats.row_tokens)]
    record_run(state, run, [list(t.tokens[: t.prompt_len]) for t in traces], outputs)
    draft_log = caches.made_draft.log if caches.made_draft is not None else []
    time_ms = _price(clock, traces, caches.made_target.log, draft_log, result.stats)
    seed = run.seed.length if run.seed is not None else 0
    return _run(traces, method, result.stats, time_ms, seed, _matches(result.sequences, width, traces, vocab))


def _price(clock: Clock, traces: Sequence[Trace], target_log: list[Forward], draft_log: list[Forward],
           stats: SpeculationStats) -> float:
    """Virtual ms: the traced prefill, every later target and draft forward, and the per-step overhead."""
    steps = len({s.step for s in stats.steps})
    return (sum(t.prefill_ms for t in traces) + sum(clock.verify_ms(f) for f in target_log[1:])
            + sum(clock.draft_ms(f) for f in draft_log) + steps * clock.step_overhead_ms)


def _matches(sequences: torch.Tensor, width: int, traces: Sequence[Trace], vocab: Vocab) -> bool:
    """Each row's generated ids equal its trace's output."""
    for seq, t in zip(sequences, traces, strict=True):
        got = vocab.decode(seq[width : width + t.new_tokens])
        if got != list(t.tokens[t.prompt_len :]):
            return False
    return True


def _run(traces: Sequence[Trace], method: str, stats: SpeculationStats, time_ms: float, seed: int,
         same: bool) -> ReplayRun:
    drafters: dict[str, int] = {}
    for s in stats.steps:
        drafters[s.drafter] = drafters.get(s.drafter, 0) + 1
    acceptance = stats.acceptance_rate
    return ReplayRun(tuple(t.question_id for t in traces), tuple(t.category for t in traces), method,
                     sum(stats.row_tokens), time_ms, len({s.step for s in stats.steps}), stats.mean_accepted_length,
                     None if math.isnan(acceptance) else acceptance, stats.mean_k, stats.plain_share,
                     dict(sorted(stats.k_histogram.items())), drafters, seed, same, stats)


def oracle_tokens_per_s(trace: Trace, clock: Clock, seed: int, k_max: int = K_MAX) -> dict[str, float]:
    """Oracle tokens/s per drafter family ("draft", "lookup": the costless drafters, "hybrid") for one trace:
    the fastest schedule knowing every acceptance, each step priced as the clock prices it (at the mid-output context, the
    step overhead included), the prefill and the draft's catch-up of the prompt less ``seed`` added."""
    n, mid = trace.new_tokens, trace.prompt_len + trace.new_tokens // 2
    seq = torch.tensor([trace.tokens])
    lookup = OracleDrafter(tuple(costless_runs(seq, trace.prompt_len, k_max)))
    verify = lambda cols: clock.verify_ms(Forward(1, cols, mid)) + clock.step_overhead_ms  # noqa: E731
    families: dict[str, list[OracleDrafter]] = {"lookup": [lookup]}
    if trace.draft:
        model = OracleDrafter(tuple(agreement_runs(trace.draft_agreement())), clock.draft_ms(Forward(1, 1, mid)),
                              clock.draft_ms(Forward(1, trace.prompt_len - seed, 0)) if trace.prompt_len > seed else 0.0)
        families.update(draft=[model], hybrid=[model, lookup])
    return {f: 1000.0 * n / (trace.prefill_ms + oracle_schedule(d, k_max, verify).time_ms) for f, d in families.items()}
