"""Per-row step records and the request's summary (tokens/s, accepted length, k histogram).

One type for any batch size: ``SpeculationStats.steps`` holds one ``StepRecord`` per active row per
step (``row``, ``step`` say which); ``stats.row(i)`` is row i's own view, and at batch size 1 the
request's summary is that one row's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace


@dataclass(frozen=True)
class StepRecord:
    """One row in one target forward: proposal length k, accepted draft tokens, tokens emitted, the
    drafter's name ("plain" for k = 0), the step's draft and verify times (ms, shared by its rows), the
    predicted acceptance α and goodput (tokens/s; NaN when not predicted), the row and step index, and
    ``predicted_ms``: the step's draft + verify time as its decision's pricing prices the step it ran
    (its realized widths; ms, NaN when not predicted), to compare with ``draft_ms + verify_ms``; ``decided``:
    False for a plain step the controller rested (no offers, no decision)."""

    k: int
    accepted: int
    emitted: int
    drafter: str
    draft_ms: float
    verify_ms: float
    alpha: float
    predicted_goodput: float
    row: int = 0
    step: int = 0
    predicted_ms: float = float("nan")
    decided: bool = True

    def token_sources(self) -> tuple[str, ...]:
        """How each of the ``emitted`` tokens was made: the drafter's name for an accepted draft token,
        then "bonus" (all k accepted) or "correction" (the target's token at the first rejection);
        "plain" for every token of a k = 0 step."""
        if self.k == 0:
            return ("plain",) * self.emitted
        last = "bonus" if self.accepted == self.k else "correction"
        return ((self.drafter,) * self.accepted + (last,))[: self.emitted]

    @property
    def realized_goodput(self) -> float:
        """Tokens emitted per second of this step's draft + verify time (compare ``predicted_goodput``)."""
        ms = self.draft_ms + self.verify_ms
        return 1000.0 * self.emitted / ms if ms > 0 else float("nan")


@dataclass
class SpeculationStats:
    """Every row's decisions of one request plus times: ``row_tokens`` generated per row, ``finish_ms``
    when each row finished (ms from the start); ``tpot_slo_ms``: the request's TPOT objective (ms/token,
    None when none was set); ``draft_prefix_tokens``: prompt tokens the draft's cache started with,
    reused from an earlier request."""

    steps: list[StepRecord] = field(default_factory=list)
    prefill_ms: float = 0.0
    wall_ms: float = 0.0
    row_tokens: tuple[int, ...] = ()
    finish_ms: tuple[float, ...] = ()
    tpot_slo_ms: float | None = None
    draft_prefix_tokens: int = 0

    @property
    def batch(self) -> int:
        """Rows in the request."""
        return len(self.row_tokens)

    @property
    def new_tokens(self) -> int:
        """Generated tokens over all rows."""
        return sum(self.row_tokens)

    def row(self, i: int) -> SpeculationStats:
        """Row i's own view: its records, tokens and finish time as wall time.

        Raises:
            IndexError: no such row.
        """
        if not 0 <= i < self.batch:
            raise IndexError(f"row {i} out of range for a batch of {self.batch}")
        return replace(
            self,
            steps=[s for s in self.steps if s.row == i],
            row_tokens=(self.row_tokens[i],),
            finish_ms=(self.finish_ms[i],),
            wall_ms=self.finish_ms[i] or self.wall_ms,
        )

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens of all rows per second of wall time (prefill included)."""
        return 1000.0 * self.new_tokens / self.wall_ms if self.wall_ms > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the prefill (1/TPOT at batch size 1)."""
        decode_ms = self.wall_ms - self.prefill_ms
        return 1000.0 * max(self.new_tokens - self.batch, 0) / decode_ms if decode_ms > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens emitted per row per target forward after the prefill (1.0 for plain decoding)."""
        return sum(s.emitted for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted draft tokens (NaN when nothing was drafted)."""
        drafted = sum(s.k for s in self.steps)
        return sum(s.accepted for s in self.steps) / drafted if drafted else float("nan")

    @property
    def mean_k(self) -> float:
        """Mean proposal length over the row-steps."""
        return sum(s.k for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def mean_latency_ms(self) -> float:
        """Mean time until a row finished (ms)."""
        return sum(self.finish_ms) / len(self.finish_ms) if self.finish_ms else self.wall_ms

    @property
    def k_histogram(self) -> dict[int, int]:
        """Row-steps per chosen k, sorted by k."""
        return dict(sorted(Counter(s.k for s in self.steps).items()))

    @property
    def plain_share(self) -> float:
        """Share of row-steps with k = 0 (plain decoding steps)."""
        return sum(1 for s in self.steps if s.k == 0) / len(self.steps) if self.steps else 0.0

    def slo_attainment(self, tpot_slo_ms: float | None = None) -> float:
        """Share of the tokens generated after the prefill whose step met the TPOT SLO: the step's
        realised (draft_ms + verify_ms) / emitted ≤ ``tpot_slo_ms`` (ms/token; default: the stored
        one). NaN when no step emitted a token (AdaSpec, arXiv 2503.05096: SLO attainment).

        Raises:
            ValueError: no SLO given or stored, or an SLO that is not > 0.
        """
        slo = self.tpot_slo_ms if tpot_slo_ms is None else tpot_slo_ms
        if slo is None or not slo > 0:
            raise ValueError(f"tpot_slo_ms must be > 0 ms (pass one or set it on the request), got {slo}")
        emitted = sum(s.emitted for s in self.steps)
        met = sum(s.emitted for s in self.steps if s.emitted and (s.draft_ms + s.verify_ms) / s.emitted <= slo)
        return met / emitted if emitted else float("nan")

    def summary(self) -> str:
        """One line: (rows,) tokens/s, mean accepted length, acceptance, k histogram, share of plain steps,
        the draft's reused prompt tokens when any, and the SLO attainment when an SLO was set."""
        hist = " ".join(f"{k}:{n}" for k, n in self.k_histogram.items())
        rows = f"{self.batch} rows, " if self.batch > 1 else ""
        line = (
            f"{rows}{self.new_tokens} tokens in {self.wall_ms / 1000:.2f} s = {self.tokens_per_s:.2f} tokens/s | "
            f"mean accepted length {self.mean_accepted_length:.2f} | acceptance {self.acceptance_rate:.2f} | "
            f"k histogram {{{hist}}} | plain steps {100 * self.plain_share:.0f}%"
        )
        if self.draft_prefix_tokens:
            line += f" | draft reused {self.draft_prefix_tokens} prompt tokens"
        if self.tpot_slo_ms is not None:
            line += f" | TPOT SLO {self.tpot_slo_ms:g} ms met by {100 * self.slo_attainment():.0f}% of tokens"
        return line

    def to_dict(self) -> dict:
        """JSON-ready summary plus every record."""
        return {
            "new_tokens": self.new_tokens,
            "row_tokens": list(self.row_tokens),
            "finish_ms": list(self.finish_ms),
            "wall_ms": self.wall_ms,
            "prefill_ms": self.prefill_ms,
            "tokens_per_s": self.tokens_per_s,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "mean_k": self.mean_k,
            "k_histogram": self.k_histogram,
            "plain_share": self.plain_share,
            "draft_prefix_tokens": self.draft_prefix_tokens,
            "tpot_slo_ms": self.tpot_slo_ms,
            "slo_attainment": self.slo_attainment() if self.tpot_slo_ms is not None else None,
            "steps": [asdict(s) for s in self.steps],
        }
