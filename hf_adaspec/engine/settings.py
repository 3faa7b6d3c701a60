"""What one request's loop runs on and returns: the decoding settings taken from ``generate`` (``DecodeSettings``),
the request's parts (``RunParts``: the target's cache, the drafters, the controller), the result (``DecodeResult``),
and ``predicted_time``, a step booked at its predicted time."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..backend.ragged import KVCache
from ..policy.controller import Controller
from ..policy.horizon import lindy_horizon
from ..proposers.base import Drafter
from .stats import SpeculationStats, StepRecord
from .threads import ThreadChooser


@dataclass
class DecodeSettings:
    """What the loop needs from the generation config: processors, stopping, the length budget (tokens),
    sampling, pad and EOS ids, the target's logits width V (a draft model with a narrower output head
    has its logits padded to it; 0: not given), and at batch size 1 the streamer and the step callback
    ``on_step(record, tokens [m])``; ``threads``: the chooser of torch's thread count per step (None: left
    as set; the caller restores it); ``decision_ms``: what the controller hears a decision cost (ms; None:
    the offers, decision and hindsight as timed); ``step_ms``: a step's time as the controller books it,
    (measured ms, decided, predicted ms) → ms (None: as measured; ``predicted_time``: as the controller's
    costs price it; a replay prices its forwards)."""

    logits_processor: object
    stopping_criteria: object
    max_length: int
    do_sample: bool
    pad_token_id: int = 0
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0
    streamer: object | None = None
    generator: torch.Generator | None = None
    on_step: Callable[[StepRecord | None, torch.Tensor], None] | None = None
    horizon: Callable[[int, int], int] = lindy_horizon  # (generated, tokens left) → tokens still to come
    threads: ThreadChooser | None = None  # picks torch's thread count per step; None: left as set
    decision_ms: float | None = None  # a decision's engine time as priced (a replay); None: measured
    step_ms: Callable[[float, bool, float], float] | None = None  # a step's booked time; None: measured


@dataclass(frozen=True)
class RunParts:
    """What one request runs on: the target's empty cache ([B] rows), the drafters in the controller's
    order, the controller, the settings, k_max (the most tokens any drafter may offer a row per step) and
    the target layers whose inputs the drafters read (a draft head's features; empty: none recorded)."""

    cache: KVCache
    drafters: tuple[Drafter, ...]
    controller: Controller
    settings: DecodeSettings
    k_max: int
    feature_layers: tuple[int, ...] = ()


@dataclass(frozen=True)
class DecodeResult:
    """sequences: [B, T + new] long (left-padded prompts, rows right-padded with the pad id)."""

    sequences: torch.Tensor
    stats: SpeculationStats


def predicted_time(measured_ms: float, decided: bool, predicted_ms: float) -> float:
    """A step booked at its predicted time (ms; as measured where it was not predicted): decisions that
    depend on the costs and the learned state alone, not on the engine's timing."""
    return measured_ms if math.isnan(predicted_ms) else predicted_ms
