"""Per-step decision records and the per-request summary (tokens/s, accepted length, k histogram)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from .cost_tracking import CostScale


@dataclass(frozen=True)
class StepRecord:
    """One target forward: proposal length k, accepted draft tokens, tokens emitted, times (ms)."""

    k: int
    accepted: int
    emitted: int
    drafter: str
    draft_ms: float
    verify_ms: float
    alpha: float
    predicted_goodput: float

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
    """All decisions of one request plus wall time; ``new_tokens`` counts the generated tokens;
    ``tpot_slo_ms``: the request's TPOT service-level objective (ms/token), None when none was set;
    ``cost_scale``: the controller's realized / predicted cost ratios at the end (None: no cost model);
    ``draft_prefix_tokens``: prompt tokens the draft's cache started with, reused from an earlier request."""

    steps: list[StepRecord] = field(default_factory=list)
    prefill_ms: float = 0.0
    wall_ms: float = 0.0
    new_tokens: int = 0
    tpot_slo_ms: float | None = None
    cost_scale: CostScale | None = None
    draft_prefix_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time (prefill included)."""
        return 1000.0 * self.new_tokens / self.wall_ms if self.wall_ms > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second after the prefill (1/TPOT)."""
        decode_ms = self.wall_ms - self.prefill_ms
        return 1000.0 * max(self.new_tokens - 1, 0) / decode_ms if decode_ms > 0 else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens emitted per target forward after the prefill (1.0 for plain decoding)."""
        return sum(s.emitted for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted draft tokens over the request (NaN when nothing was drafted)."""
        drafted = sum(s.k for s in self.steps)
        return sum(s.accepted for s in self.steps) / drafted if drafted else float("nan")

    @property
    def mean_k(self) -> float:
        """Mean proposal length over the steps."""
        return sum(s.k for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def mean_latency_ms(self) -> float:
        """Time until the request finished (ms): its wall time (same name as for a batch)."""
        return self.wall_ms

    @property
    def k_histogram(self) -> dict[int, int]:
        """Steps per chosen k, sorted by k."""
        return dict(sorted(Counter(s.k for s in self.steps).items()))

    @property
    def plain_share(self) -> float:
        """Share of steps with k = 0 (plain decoding steps)."""
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
        """One line: tokens/s, mean accepted length, acceptance, k histogram, share of plain steps, the
        draft's reused prompt tokens when any, and the SLO attainment when an SLO was set."""
        hist = " ".join(f"{k}:{n}" for k, n in self.k_histogram.items())
        line = (
            f"{self.new_tokens} tokens in {self.wall_ms / 1000:.2f} s = {self.tokens_per_s:.2f} tokens/s | "
            f"mean accepted length {self.mean_accepted_length:.2f} | acceptance {self.acceptance_rate:.2f} | "
            f"k histogram {{{hist}}} | plain steps {100 * self.plain_share:.0f}%"
        )
        if self.draft_prefix_tokens:
            line += f" | draft reused {self.draft_prefix_tokens} prompt tokens"
        if self.tpot_slo_ms is not None:
            line += f" | TPOT SLO {self.tpot_slo_ms:g} ms met by {100 * self.slo_attainment():.0f}% of tokens"
        return line

    def to_dict(self) -> dict:
        """JSON-ready summary plus every step."""
        return {
            "new_tokens": self.new_tokens,
            "wall_ms": self.wall_ms,
            "prefill_ms": self.prefill_ms,
            "tokens_per_s": self.tokens_per_s,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "k_histogram": self.k_histogram,
            "plain_share": self.plain_share,
            "draft_prefix_tokens": self.draft_prefix_tokens,
            "tpot_slo_ms": self.tpot_slo_ms,
            "slo_attainment": self.slo_attainment() if self.tpot_slo_ms is not None else None,
            "cost_scale": asdict(self.cost_scale) if self.cost_scale is not None else None,
            "steps": [asdict(s) for s in self.steps],
        }


@dataclass(frozen=True)
class BatchStepRecord:
    """One batched target forward: per active row its proposal length k_i, accepted tokens and drafter
    ("plain" when k_i = 0) (tuples of the batch size), the step's draft and verify time (ms) and the
    predicted batch goodput (tokens/s)."""

    ks: tuple[int, ...]
    accepted: tuple[int, ...]
    draft_ms: float
    verify_ms: float
    predicted_goodput: float
    drafters: tuple[str, ...] = ()

    @property
    def batch(self) -> int:
        """Rows still generating at this step."""
        return len(self.ks)

    @property
    def k(self) -> int:
        """Batch-wide proposal length: every row is verified over k + 1 positions."""
        return max(self.ks, default=0)


@dataclass
class BatchSpeculationStats:
    """All decisions of one batched request: per-row new tokens and finish times (ms from the start)."""

    steps: list[BatchStepRecord] = field(default_factory=list)
    prefill_ms: float = 0.0
    wall_ms: float = 0.0
    new_tokens: tuple[int, ...] = ()
    finish_ms: tuple[float, ...] = ()

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens of all rows per second of wall time (prefill included)."""
        return 1000.0 * sum(self.new_tokens) / self.wall_ms if self.wall_ms > 0 else 0.0

    @property
    def mean_latency_ms(self) -> float:
        """Mean time until a row finished (ms)."""
        return sum(self.finish_ms) / len(self.finish_ms) if self.finish_ms else 0.0

    @property
    def mean_k(self) -> float:
        """Mean batch-wide proposal length over the steps."""
        return sum(s.k for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens over all rows (NaN when nothing was drafted)."""
        drafted = sum(sum(s.ks) for s in self.steps)
        return sum(sum(s.accepted) for s in self.steps) / drafted if drafted else float("nan")

    @property
    def plain_share(self) -> float:
        """Share of steps with k = 0 for every row (plain batched decoding steps)."""
        return sum(1 for s in self.steps if s.k == 0) / len(self.steps) if self.steps else 0.0

    def summary(self) -> str:
        """One line: rows, tokens/s over the batch, mean latency, acceptance, mean k, plain steps."""
        return (
            f"{len(self.new_tokens)} rows, {sum(self.new_tokens)} tokens in {self.wall_ms / 1000:.2f} s = "
            f"{self.tokens_per_s:.2f} tokens/s | mean latency {self.mean_latency_ms / 1000:.2f} s | "
            f"acceptance {self.acceptance_rate:.2f} | mean k {self.mean_k:.2f} | plain steps {100 * self.plain_share:.0f}%"
        )

    def to_dict(self) -> dict:
        """JSON-ready summary plus every step."""
        return {
            "new_tokens": list(self.new_tokens), "finish_ms": list(self.finish_ms), "wall_ms": self.wall_ms,
            "prefill_ms": self.prefill_ms, "tokens_per_s": self.tokens_per_s,
            "mean_latency_ms": self.mean_latency_ms, "acceptance_rate": self.acceptance_rate,
            "mean_k": self.mean_k, "plain_share": self.plain_share, "steps": [asdict(s) for s in self.steps],
        }
