"""Replay's virtual clock: what each logged forward of a replayed request costs (ms), priced by a cost profile.

Design: time in a replay is not measured but priced. ``Clock`` prices a target forward (verification of n tokens at
b rows and context c), a draft's forward (one token, plus caught-up columns) and a draft head's from a profile, the
prefill as the trace timed it (or by the profile, for a projection onto another machine), plus fixed overheads per
step of the engine and per token of transformers' plain loop. ``StepPrices`` gives the engine each step's virtual
time as it runs (so the slowdown ledger books the virtual clock), and ``price_request`` a whole request's.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..costs.profile import Profile
from ..engine.stats import SpeculationStats
from .trace import Trace
from .virtual import Forward, TraceCaches, VirtualHead

PREFILL_PRICES = ("trace", "profile")
PLAIN_PRICES = ("profile", "trace")
_CONTEXT_STEP = 8  # contexts are priced in buckets of 8 tokens (a cost barely moves within one), so prices cache well


class Clock:
    """Prices forwards (ms): a cost ``profile`` (the target's and the draft's cells), the engine's fixed
    ``step_overhead_ms`` per step it decides, ``plain_overhead_ms`` per token of plain decoding (and per step
    the engine rests), a draft
    head's forwards from ``head_profile`` (a profile measured with the head, of the same target; None: no
    head costs), and the prefill as the trace timed it (``prefill="trace"``) or by the profile
    (``"profile"``: a projection onto another machine, whose prefill the trace's machine did not time). Plain
    decoding (the baseline of every speedup) is the engine's forwards priced by the profile plus
    ``plain_overhead_ms`` a token (``plain="profile"``), or transformers' plain ``generate`` as the trace timed it
    (``"trace"``, batch size 1, the trace's machine only: what a bench's plain run takes there, its attention and
    cache included).

    Raises:
        ValueError: a ``head_profile`` not measured with a head, or measured for another target; another
            ``prefill`` or ``plain``.
    """

    def __init__(
        self,
        profile: Profile,
        step_overhead_ms: float = 0.0,
        plain_overhead_ms: float = 0.0,
        head_profile: Profile | None = None,
        prefill: str = "trace",
        plain: str = "profile",
    ) -> None:
        if prefill not in PREFILL_PRICES:
            raise ValueError(f"prefill={prefill!r}; choose one of {PREFILL_PRICES}")
        if plain not in PLAIN_PRICES:
            raise ValueError(f"plain={plain!r}; choose one of {PLAIN_PRICES}")
        self.prefill, self.plain = prefill, plain
        if head_profile is not None and not head_profile.drafter_is_head:
            raise ValueError(
                f"head profile {head_profile.key} was measured with a draft model, not a head; "
                "measure one with `hf-adaspec profile --head FOLDER`"
            )
        if head_profile is not None and head_profile.identity.get("target") != profile.identity.get("target"):
            raise ValueError(
                f"head profile {head_profile.key} was measured for another target than profile "
                f"{profile.key}; measure both for the same target"
            )
        self.profile, self.step_overhead_ms, self.plain_overhead_ms = profile, step_overhead_ms, plain_overhead_ms
        self.head_profile = head_profile
        self._cache: dict[tuple[str, int, int, int], float] = {}

    @property
    def decision_ms(self) -> float:
        """What a decision costs the engine beyond a plain step (ms): the step overheads' difference, which
        the controller hears as its decisions' time (0: it never rests)."""
        return max(0.0, self.step_overhead_ms - self.plain_overhead_ms)

    def _priced(self, role: str, f: Forward) -> float:
        key = (role, f.batch, max(1, f.context // _CONTEXT_STEP * _CONTEXT_STEP), f.columns)
        if key not in self._cache:
            _, b, c, n = key
            drafter = self.head_profile if role == "head" else self.profile
            self._cache[key] = (
                self.profile.verify_ms(b, c, n)
                if role == "target"
                else drafter.draft_ms(b, c) + (n - 1) * drafter.catchup_ms(b, c)
            )
        return self._cache[key]

    def prefill_ms(self, traces: Sequence[Trace]) -> float:
        """The prefill of a batch of ``traces`` (ms): their traced prefills, or the profile's price of one
        forward over the padded prompts (its table extrapolates the widest measured forward)."""
        if self.prefill == "trace":
            return sum(t.prefill_ms for t in traces)
        return self.verify_ms(Forward(len(traces), max(t.prompt_len for t in traces), 0))

    def traced_plain_ms(self, traces: Sequence[Trace]) -> float:
        """transformers' plain ``generate`` of one trace's output as the trace timed it (ms, prefill included).

        Raises:
            ValueError: more than one trace (a batch's plain run is not traced), or a trace without plain times.
        """
        if len(traces) != 1 or not traces[0].plain_ms:
            raise ValueError(
                "plain='trace' prices batch size 1 from traces with plain times; use batch size 1 and traces "
                "taken by this version's `hf-adaspec trace`, or price plain decoding by the profile"
            )
        return traces[0].plain_ms[-1]

    def verify_ms(self, f: Forward) -> float:
        """A target forward over f.columns new tokens (ms)."""
        return self._priced("target", f)

    def draft_ms(self, f: Forward) -> float:
        """A draft forward: one token, plus (columns − 1) caught-up tokens (ms)."""
        return self._priced("draft", f)

    def head_ms(self, f: Forward) -> float:
        """A head forward: one token, plus (columns − 1) ingested entries (ms). Raises ValueError without
        head costs."""
        if self.head_profile is None:
            raise ValueError(
                "no head costs: pass a profile measured by `hf-adaspec profile --head FOLDER` (replay's --head-profile)"
            )
        return self._priced("head", f)


class StepPrices:
    """A replayed step's time as ``_price`` prices the request (so the slowdown ledger books the virtual
    clock): the target, draft and head forwards logged since the last step, plus the engine's overhead of
    a decided step or of a plain (rested) one. The target's first logged forward, the prefill, is not a step."""

    def __init__(self, clock: Clock, caches: TraceCaches, head: VirtualHead | None) -> None:
        self.clock, self.caches, self.head = clock, caches, head
        self.seen = [1, 0, 0]  # forwards already priced per log: target (its prefill skipped), draft, head

    def __call__(self, measured_ms: float, decided: bool, predicted_ms: float) -> float:
        """(the engine's measured ms and the controller's prediction, both ignored; whether the step was
        decided) → the step's virtual ms."""
        made = self.caches.made_target, self.caches.made_draft
        logs = (
            made[0].log if made[0] is not None else [],
            made[1].log if made[1] is not None else [],
            self.head.log if self.head is not None else [],
        )
        prices = (self.clock.verify_ms, self.clock.draft_ms, self.clock.head_ms)
        ms = sum(price(f) for log, price, at in zip(logs, prices, self.seen, strict=True) for f in log[at:])
        self.seen = [len(log) for log in logs]
        return ms + (self.clock.step_overhead_ms if decided else self.clock.plain_overhead_ms)


def price_request(
    clock: Clock,
    traces: Sequence[Trace],
    target_log: list[Forward],
    drafter_logs: tuple[list[Forward], list[Forward]],
    stats: SpeculationStats,
) -> float:
    """Virtual ms: the prefill, every later target, draft and head forward, and the per-step overhead (a
    rested step's: the plain one's)."""
    steps, decided = len({s.step for s in stats.steps}), len({s.step for s in stats.steps if s.decided})
    draft_log, head_log = drafter_logs
    return (
        clock.prefill_ms(traces)
        + sum(clock.verify_ms(f) for f in target_log[1:])
        + sum(clock.draft_ms(f) for f in draft_log)
        + sum(clock.head_ms(f) for f in head_log)
        + decided * clock.step_overhead_ms
        + (steps - decided) * clock.plain_overhead_ms
    )
