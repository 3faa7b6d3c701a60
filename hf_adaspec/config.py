"""``SpeculationConfig``: how to speculate, validated on construction (every ``generate`` keyword that sets it)."""

from __future__ import annotations

from dataclasses import dataclass

from .modes import SPECULATION_MODES


@dataclass(frozen=True)
class SpeculationConfig:
    """How to speculate.

    speculation: a key of ``SPECULATION_MODES``: "adaptive" (goodput-chosen k per step, down to 0),
    "fixed" (always ``num_speculative_tokens``), "hybrid" (each step the best of a plain step, a
    prompt-lookup proposal and a draft-model proposal by predicted goodput; needs a draft model),
    "confidence" (the draft model drafts while its calibrated confidence predicts rising goodput,
    AdaSpec; in a batch also token elimination before verification), "hybrid-confidence" (as "hybrid",
    with the draft model priced and stopped as "confidence" does; batch size 1) or "pmin"
    (llama.cpp-style: drafts up to k_max, stopping once a token's draft probability < ``draft_p_min``;
    batch size 1).
    max_speculative_tokens: k_max.
    prompt_lookup_max_ngram: n-gram size for the prompt-lookup drafter (used when no draft model is
    given). min_gain: relative goodput margin a k > 0 must predict over a plain step to be chosen.
    tpot_slo_ms: a time-per-output-token objective (ms/token): adaptive, hybrid and confidence skip
    choices predicted to break it (best effort when none meets it); every mode reports its attainment.
    adapt_costs: at batch size 1, adaptive, hybrid and confidence correct a measured cost table (profile
    or calibration, not a ``speculation_costs`` table given as is) by each step's realized times
    (``cost_tracking``). Off by default: on the Spec-Bench runs it made the draft-model controllers
    draft less and was not faster (README); the ratios are measured either way (``.speculation``).
    target_confidence: on steps that do not draft with the draft model, the target's top probability
    stands in for it (``target_confidence``): "confidence" folds the draft confidence it predicts into
    the request's mean c̄, adaptive and hybrid the acceptance it predicts into the draft model's α; so
    a request can return to drafting without paying for drafts to learn that it should. Off by
    default: on Spec-Bench it made the controllers draft more but not faster (README).
    learn_horizon: amortise a draft's catch-up over the tokens the model's past requests ran past this
    point (``horizon.LengthMemory``); False: over as many tokens as generated so far (``lindy_horizon``).
    horizon_quantile: with ``learn_horizon``, amortise over this quantile of those past requests'
    remaining lengths (a hedge against short answers, ``horizon``); None: over their mean.
    alpha_prior_quantile: adaptive and hybrid start each request's α at this quantile of the pair's
    recent requests' acceptance rates (``AcceptanceMemory``; until three requests have drafted, of the
    initial Beta prior for the draft model, and ``LOOKUP_START_ALPHA`` for prompt lookup); None: at their
    running mean.
    recalibrate: "confidence" and "hybrid-confidence" scale the pair's confidence calibration by the
    request's observed / expected accepted draft tokens (``recalibration``), at batch size 1.
    reuse_draft_prefix: at batch size 1 the draft model's cache starts from the longest prefix the prompt
    shares with a recent request's (``draft_prefix``: the chat template's system turn, a conversation's
    history), so its catch-up ingests only the rest; the target still ingests the whole prompt.
    lookup_hindsight: adaptive, hybrid and hybrid-confidence at batch size 1 also learn prompt lookup's α
    on the steps it is not verified, from the proposal it would have made scored against the tokens the
    step emitted (``hindsight``: free, since a lookup proposal needs no forward pass). Off by default: on
    Spec-Bench it changed hybrid-confidence by 1.007x / 0.994x per prompt in two runs (README).
    """

    speculation: str = "adaptive"
    num_speculative_tokens: int | None = None
    max_speculative_tokens: int = 8
    prompt_lookup_max_ngram: int = 3
    min_gain: float = 0.03
    draft_p_min: float = 0.75
    tpot_slo_ms: float | None = None
    adapt_costs: bool = False
    target_confidence: bool = False
    learn_horizon: bool = True
    horizon_quantile: float | None = None
    alpha_prior_quantile: float | None = 0.75
    recalibrate: bool = False
    reuse_draft_prefix: bool = True
    lookup_hindsight: bool = False

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(
                f"speculation={self.speculation!r} is not supported; use one of {tuple(SPECULATION_MODES)} "
                "(or leave it out for transformers' own generate)"
            )
        if self.speculation == "fixed" and self.num_speculative_tokens is None:
            raise ValueError('speculation="fixed" needs num_speculative_tokens=k (k >= 0)')
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.min_gain < 0:
            raise ValueError(f"min_gain must be >= 0, got {self.min_gain}")
        if self.max_speculative_tokens < 1:
            raise ValueError(f"max_speculative_tokens must be >= 1, got {self.max_speculative_tokens}")
        if not 0.0 <= self.draft_p_min <= 1.0:
            raise ValueError(f"draft_p_min must be in [0, 1], got {self.draft_p_min}")
        if self.alpha_prior_quantile is not None and not 0.0 <= self.alpha_prior_quantile <= 1.0:
            raise ValueError(f"alpha_prior_quantile must be in [0, 1] (or None for the running mean), "
                             f"got {self.alpha_prior_quantile}")
        if self.horizon_quantile is not None and not 0.0 <= self.horizon_quantile <= 1.0:
            raise ValueError(f"horizon_quantile must be in [0, 1] (or None for the mean), got {self.horizon_quantile}")
        if self.tpot_slo_ms is not None and not self.tpot_slo_ms > 0:
            raise ValueError(f"tpot_slo_ms must be > 0 ms per token (or None for no SLO), got {self.tpot_slo_ms}")

    @property
    def k_max(self) -> int:
        """Largest proposal length the controller may pick."""
        if self.speculation == "fixed":
            return self.num_speculative_tokens or 0
        return self.max_speculative_tokens
