"""One request's assembly, for ``generate`` and for the replay alike.

``build_run`` turns (config, learned state, the prompt, the draft model or its trace stand-in, the caches
that answer for them, costs, decoding settings) into what the loop runs on (``RunParts``: the target's
cache, the drafters of the mode, its controller, the settings), taking the drafters, how each is priced
and which learned tables it uses from the mode registry (``policy.modes.MODES``). ``record_run`` keeps
what the finished request taught the pair: its prompts and outputs in suffix drafting's memory and, at
batch size 1, the draft's cache in the prefix store. ``SpeculationState`` is that learned state.
``run_request`` is one ``generate`` request, whole: its caches (``backend.caches``), its costs, ``build_run``,
the loop and ``record_run``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from ..backend.caches import ModelCaches
from ..backend.draft_prefix import DraftPrefixStore, PrefixSeed
from ..backend.ragged import KVCache
from ..config import SpeculationConfig
from ..costs.cache import CostCache
from ..costs.table import CostTable
from ..models.eagle3 import HeadKV
from ..policy.confidence import CalibratorMemory
from ..policy.match import MatchMemory
from ..policy.modes import MODES, DrafterContext, DrafterSpec, Learned, PolicyInputs, assistant_identity
from ..proposers.suffix import SuffixMemory
from .loop import speculative_decode
from .settings import DecodeResult, DecodeSettings, RunParts
from .threads import ThreadChooser


@dataclass
class SpeculationState:
    """What ``generate`` learns across requests of one model: the draft's confidence calibration (keyed by
    the assistant's weights, ``policy.modes.assistant_identity``), the costless drafters' acceptance per match
    length (``matches``), the draft's recent caches (``draft_prefixes``, per draft model object), for suffix
    drafting the recent responses (``suffixes``) and, on a CPU, which thread count decodes fastest
    (``threads``). The model's ``engine.owner.ModelState`` (``enable`` makes it) holds one, so decisions —
    and with them sampled outputs — change from call to call as it learns;
    ``generate(..., speculation_state=SpeculationState())`` starts a call (or a workload, or a benchmarked
    method) from a fresh one."""

    calibrators: CalibratorMemory = field(default_factory=CalibratorMemory)
    matches: MatchMemory = field(default_factory=MatchMemory)
    draft_prefixes: DraftPrefixStore = field(default_factory=DraftPrefixStore)
    suffixes: SuffixMemory = field(default_factory=SuffixMemory)
    threads: ThreadChooser = field(default_factory=lambda: ThreadChooser.for_threads(torch.get_num_threads()))


class Caches(Protocol):
    """Makes a request's caches (``backend.caches.ModelCaches``, or the replay's that answer from traces): the
    target's (whose forwards record the feature ``layers``), the draft model's from a prefix seed (None:
    empty), and the draft head's."""

    def target(self, batch: int, layers: tuple[int, ...] = ()) -> KVCache: ...

    def draft(self, batch: int, seed: PrefixSeed | None) -> KVCache: ...

    def head(self, batch: int) -> HeadKV: ...


@dataclass(frozen=True)
class PreparedRun:
    """A built request: what the loop runs on (``parts``), the drafters' specs in the same order, the draft's
    identity in the learned state (``draft_key``, None without one), its cache and its prefix seed (batch
    size 1 without padding; None otherwise)."""

    parts: RunParts
    specs: tuple[DrafterSpec, ...]
    draft_key: object | None
    draft_cache: KVCache | None
    seed: PrefixSeed | None


def build_run(
    config: SpeculationConfig,
    state: SpeculationState,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    draft_key: object | None,
    caches: Caches,
    costs_for: Callable[[int], CostTable],
    settings: DecodeSettings,
) -> PreparedRun:
    """Everything one request of ``config``'s mode needs. input_ids, attention_mask: [B, T] (left-padded);
    ``draft_key``: the assistant (a draft model, a draft head, or the replay's stand-in for a draft model),
    None without one; ``costs_for(b)``: the cost table at b rows. The drafters and their pricing come from
    ``policy.modes.MODES``; at batch size 1 without padding a draft model's cache starts from the longest
    prompt prefix the pair's prefix store holds."""
    batch, mode = input_ids.shape[0], MODES[config.speculation]
    specs = mode.drafters(draft_key)
    seeded = any(spec.uses_draft_cache for spec in specs)
    seed = None
    if seeded and batch == 1 and bool(attention_mask.all()):
        seed = state.draft_prefixes.seed(draft_key, input_ids[0])
    draft_cache = caches.draft(batch, seed) if seeded else None
    head_cache = caches.head(batch) if any(spec.uses_head_cache for spec in specs) else None
    context = DrafterContext(
        batch,
        config,
        settings.logits_processor,
        settings.do_sample,
        settings.pad_token_id,
        settings.eos_token_ids,
        draft_key,
        draft_cache,
        state.suffixes,
        settings.generator,
        settings.vocab_size,
        head_cache,
    )
    drafters = tuple(spec.build(context) for spec in specs)
    learned = Learned(state.calibrators, state.matches)
    identity = assistant_identity(draft_key)
    inputs = PolicyInputs(config, costs_for, batch, tuple((s, s.memory_key(identity)) for s in specs), learned)
    features = tuple(layer for spec in specs for layer in spec.target_features(draft_key))
    target_cache = caches.target(batch, features)
    parts = RunParts(target_cache, drafters, mode.controller(inputs), settings, config.k_max, features)
    return PreparedRun(parts, specs, draft_key, draft_cache, seed)


def record_run(
    state: SpeculationState, run: PreparedRun, prompts: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]
) -> None:
    """Keep what the finished ``run`` taught the pair: each row's real prompt and generated tokens (token
    ids) in suffix drafting's memory, where a drafter of the run remembers responses, and at batch size 1
    the draft's cache (with the tokens it holds) in the prefix store."""
    if any(spec.remembers_responses for spec in run.specs):
        for prompt, output in zip(prompts, outputs, strict=True):
            state.suffixes.remember(prompt, output)
    if run.seed is not None and run.draft_cache is not None:
        held = int(run.draft_cache.lengths[0])
        if held > run.seed.length:  # the store keeps only caches that grew (an arena's export is a copy)
            state.draft_prefixes.remember(
                run.draft_key, [*prompts[0], *outputs[0]], held, run.seed.length, run.draft_cache.export_prefix()
            )


def run_request(
    target: torch.nn.Module,
    assistant: torch.nn.Module | None,
    config: SpeculationConfig,
    state: SpeculationState,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    settings: DecodeSettings,
    costs: CostTable | None = None,
    profile: str | Path | None = None,
) -> DecodeResult:
    """One ``generate`` request, whole: input_ids, attention_mask [B, T] (left-padded) → the loop's result,
    learning into ``state``. Its caches are ``ModelCaches.for_request``'s; its costs at b rows the given
    table, else the pair's profile (``profile``, or the cached one) at the padded prompt length or tables
    calibrated at b = 1, 2, 4, … and B (``CostCache.costs_for``); torch's thread count is restored after."""
    batch, width = input_ids.shape
    caches = ModelCaches.for_request(target, assistant, config.kv_cache, config.k_max, width, settings.max_length)
    if costs is None:
        log = functools.partial(print, file=sys.stderr)
        costs_for = CostCache().costs_for(
            target, assistant, config.max_speculative_tokens + 1, log, batch, width, profile, config.kv_cache
        )
    else:
        costs_for = lambda b: costs  # noqa: E731
    run = build_run(config, state, input_ids, attention_mask, assistant, caches, costs_for, settings)
    threads_before = torch.get_num_threads()  # the chooser may change it per step
    try:
        result = speculative_decode(run.parts, input_ids, attention_mask)
    finally:
        torch.set_num_threads(threads_before)
    result.stats.tpot_slo_ms = config.tpot_slo_ms
    rows = range(batch)
    record_run(
        state,
        run,
        [input_ids[i][attention_mask[i].bool()].tolist() for i in rows],
        [result.sequences[i, width : width + result.stats.row_tokens[i]].tolist() for i in rows],
    )
    if run.seed is not None:
        result.stats.draft_prefix_tokens = run.seed.length
    return result
