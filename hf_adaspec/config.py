"""``SpeculationConfig``: how to speculate, validated on construction (every ``generate`` keyword that sets it)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

ADAPTIVE, FIXED = "adaptive", "fixed"
SPECULATION_MODES = (ADAPTIVE, FIXED)  # what each does: ``policy.modes.MODES``
KV_CACHES = ("auto", "dynamic", "static")  # where keys and values live: ``backend.stores``
DEFAULT_MAX_SLOWDOWN = 0.02  # ε: a request may decode at most 2% slower than plain (plus one step)


@dataclass(frozen=True)
class SpeculationConfig:
    """How to speculate.

    speculation: "adaptive" (each step a plain step, prompt lookup or the draft model, whichever predicts
    the most goodput; prompt lookup alone without a draft model) or "fixed" (always
    ``num_speculative_tokens``, a baseline).
    num_speculative_tokens: k for "fixed" (required there, >= 0).
    max_speculative_tokens: k_max for "adaptive" (1..64).
    prompt_lookup_max_ngram: n-gram size for prompt lookup (>= 1).
    tpot_slo_ms: a time-per-output-token objective (ms/token) that "adaptive" respects where it can
    (best effort when no choice meets it); batch size 1.
    draft_p_min: "fixed" only: stop drafting once a drafted token's draft probability q(x) < p_min (the
    llama.cpp ``--draft-p-min`` baseline); None: always k.
    adapt_threads: on a CPU, let the engine pick torch's thread count per step (torch's count or 1) from
    realized step times (``engine.threads``); False: torch's count as set.
    rest: "adaptive" only: in a run of plain decisions skip deciding for a few steps where a decision's
    measured time is over 1% of the plain steps' (``policy.rest``); False: decide every step and book each
    step in the slowdown ledger at its predicted time, so decisions (and seeded sampled outputs) depend on
    the costs and the learned state alone, not on the engine's timing.
    max_slowdown: "adaptive" only: ε, the share by which a request may decode slower than plain decoding (plus
    one step) while speculation explores (``policy.ledger``: a speculative step is taken only where its
    pessimistic outcome keeps the request within it); 0.02 by default, math.inf for no bound.
    kv_cache: "auto" (a preallocated cache whose narrow forwards replay captured CUDA graphs on a GPU, a
    transformers ``DynamicCache`` elsewhere), "dynamic" or "static" (on a CPU, the static path's bookkeeping
    with each recording re-run instead of replayed: a check, not a speed-up).

    Raises:
        ValueError: an unknown mode, a proposal length or n-gram size that is not an integer (bool and float
            refused), or an out-of-range value, naming the fix.
    """

    speculation: str = "adaptive"
    num_speculative_tokens: int | None = None
    max_speculative_tokens: int = 8
    prompt_lookup_max_ngram: int = 3
    tpot_slo_ms: float | None = None
    draft_p_min: float | None = None
    adapt_threads: bool = True
    rest: bool = True
    max_slowdown: float = DEFAULT_MAX_SLOWDOWN
    kv_cache: str = "auto"

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(
                f"speculation={self.speculation!r} is not supported; use one of {SPECULATION_MODES} "
                "(or leave it out for transformers' own generate)"
            )
        if self.speculation == FIXED and self.num_speculative_tokens is None:
            raise ValueError('speculation="fixed" needs num_speculative_tokens=k (k >= 0)')
        if self.speculation != FIXED and (self.num_speculative_tokens is not None or self.draft_p_min is not None):
            raise ValueError(
                'num_speculative_tokens and draft_p_min belong to speculation="fixed"; "adaptive" '
                "chooses k itself (cap it with max_speculative_tokens)"
            )
        for name in ("num_speculative_tokens", "max_speculative_tokens", "prompt_lookup_max_ngram"):
            _check_integer(name, getattr(self, name))
        if self.num_speculative_tokens is not None and not 0 <= self.num_speculative_tokens <= 64:
            raise ValueError(f"num_speculative_tokens must be in [0, 64], got {self.num_speculative_tokens}")
        if not 1 <= self.max_speculative_tokens <= 64:
            raise ValueError(f"max_speculative_tokens must be in [1, 64], got {self.max_speculative_tokens}")
        if self.prompt_lookup_max_ngram < 1:
            raise ValueError(f"prompt_lookup_max_ngram must be >= 1, got {self.prompt_lookup_max_ngram}")
        if self.draft_p_min is not None and not 0.0 <= self.draft_p_min <= 1.0:
            raise ValueError(f"draft_p_min must be in [0, 1], got {self.draft_p_min}")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache={self.kv_cache!r}; choose one of {KV_CACHES}")
        for name in ("adapt_threads", "rest"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        check_slowdown(self.max_slowdown)
        if self.tpot_slo_ms is not None and not self.tpot_slo_ms > 0:
            raise ValueError(f"tpot_slo_ms must be > 0 ms per token (or None for no SLO), got {self.tpot_slo_ms}")

    @property
    def k_max(self) -> int:
        """Largest proposal length the controller may pick."""
        if self.speculation == FIXED:
            return self.num_speculative_tokens or 0
        return self.max_speculative_tokens


def _check_integer(name: str, value: object) -> None:
    """Raise ValueError unless ``value`` is an integer (None passes: unset); a bool or a float is refused."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise ValueError(
            f"{name} must be an integer (a number of tokens), got {value!r} of type {type(value).__name__}"
        )


def check_slowdown(epsilon: object) -> None:
    """Raise ValueError unless ε (``max_slowdown``) is a number >= 0 (math.inf: no bound)."""
    if isinstance(epsilon, bool) or not isinstance(epsilon, numbers.Real) or math.isnan(epsilon) or epsilon < 0:
        raise ValueError(
            f"max_slowdown must be a number >= 0 (a share of plain decoding's time, e.g. 0.02; "
            f"math.inf for no bound), got {epsilon!r}"
        )
