"""Suffix drafting (SuffixDecoding, arXiv 2411.04975; vLLM's ``suffix`` method) as the adaptive policy's
costless drafter, instead of or beside prompt lookup, decided by replay (issue 26 item 1).

Every variant runs the real engine and ``AdaptiveController`` (built by ``SPECULATION_MODES["adaptive"]``)
on the recorded greedy traces, priced by the pair's cost profile, learned state carried across requests
in order (as ``hf-adaspec replay`` does). The drafters of each method:

    adaptive                 draft model + prompt lookup      (the current policy)
    adaptive/suffix          draft model + suffix             (suffix instead of lookup)
    adaptive/both            draft model + lookup + suffix    (suffix joins lookup)
    adaptive-lookup          prompt lookup                    (no draft model, current)
    adaptive-lookup/suffix   suffix
    adaptive-lookup/both     lookup + suffix

The suffix drafter (``hf_adaspec.proposers.suffix``) remembers earlier requests' responses (FIFO,
bounded) in a ``SuffixMemory`` carried across requests like the learned state, and is priced by a
``MatchTable`` of its own over its match length. Replays here use one vocabulary for the whole run (the
stock replay compacts ids per request, which would scramble a cross-request memory); the baselines are
replayed the same way and also checked against the stock ``replay_all`` (same numbers).

Oracle: per prompt the fastest schedule knowing every acceptance (``oracle.oracle_schedule``) over each
method's drafters; the suffix drafter's runs are its k_max-token proposal at every position with the
memory the requests before left (deterministic: outputs are the traces'), so "% of oracle" is against
the oracle of the method's own drafter set; "% of all" against the oracle with all three drafters.

Workloads: Spec-Bench held-out (52 first turns, independent requests), code (16 CPython-stdlib prompts,
held-out half and all), and a synthetic "session": each code trace replayed twice in a row (the repeat's
answer is in memory). Tuning (``--tune``) varies the suffix drafter's settings on the tune split only and
compares every method there; an ablation replays the suffix drafter without memory of earlier requests.

Run: .venv/bin/python benchmarks/suffix_replay.py [--tune] [--output benchmarks/results/suffix_replay.json]
Last stdout line: one JSON object (the summary).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import LogitsProcessorList

from hf_adaspec.config import SpeculationConfig
from hf_adaspec.costs.profile import load_profile
from hf_adaspec.engine.loop import DecodeSettings, speculative_decode
from hf_adaspec.engine.ragged import left_pad
from hf_adaspec.policy.modes import SPECULATION_MODES, Learned, PolicyInputs
from hf_adaspec.proposers import DraftModelProposer, PromptLookupProposer, Proposer
from hf_adaspec.proposers.suffix import SuffixMemory, SuffixProposer
from hf_adaspec.seam.integration import SpeculationState, memory_key
from hf_adaspec.tools.bench_oracle import lookup_runs
from hf_adaspec.tools.oracle import OracleDrafter, agreement_runs, oracle_schedule
from hf_adaspec.tools.replay import (
    K_MAX,
    Clock,
    PrefixMemory,
    ReplayRun,
    VirtualDraft,
    _matches,
    _price,
    _run,
    _stopping,
    plain_run,
)
from hf_adaspec.tools.replay_report import replay_all
from hf_adaspec.tools.trace import Trace, load_traces
from hf_adaspec.tools.virtual import Forward, TraceCache, Vocab, draft_answers, target_answers

PROFILE = "model_cards/qwen2.5-coder-1.5b_0.5b/profile.json"
METHODS = {  # name → (with the draft model, costless drafters)
    "adaptive": (True, ("lookup",)),
    "adaptive/suffix": (True, ("suffix",)),
    "adaptive/both": (True, ("lookup", "suffix")),
    "adaptive-lookup": (False, ("lookup",)),
    "adaptive-lookup/suffix": (False, ("suffix",)),
    "adaptive-lookup/both": (False, ("lookup", "suffix")),
}
DEFAULT_SUFFIX = {"max_depth": 24, "spec_factor": 1.0, "spec_offset": 0.0, "min_token_prob": 0.1,
                  "prompts": False, "max_requests": 256, "max_tokens": 1 << 16}  # vLLM's defaults, bounded memory


@dataclass
class State:
    """What one method learns across requests: the seam's state, the draft's prefix store, the suffix memory."""

    learned: SpeculationState = field(default_factory=SpeculationState)
    prefixes: PrefixMemory = field(default_factory=PrefixMemory)
    suffixes: SuffixMemory | None = None


def _suffix(memory: SuffixMemory, prompt_lengths: list[int], settings: dict) -> SuffixProposer:
    return SuffixProposer(memory, prompt_lengths, settings["max_depth"], settings["spec_factor"],
                          settings["spec_offset"], settings["min_token_prob"])


def _memory(settings: dict) -> SuffixMemory:
    return SuffixMemory(settings["max_requests"], settings["max_tokens"], settings["prompts"])


def replay_request(traces: Sequence[Trace], method: str, state: State, clock: Clock, vocab: Vocab,
                   suffix: dict) -> ReplayRun:
    """``hf_adaspec.tools.replay.replay_request`` with a chosen set of costless drafters and one vocabulary
    for the whole run; a finished request's prompt and output go to the suffix memory."""
    if method == "plain":
        return plain_run(traces, clock)
    with_draft, costless = METHODS[method]
    config = SpeculationConfig(speculation="adaptive")
    eos = vocab.encode(traces[0].eos)
    pad = int(eos[0]) if eos.numel() else 0
    rows = [vocab.encode(t.tokens) for t in traces]
    input_ids, valid = left_pad([r[: t.prompt_len] for r, t in zip(rows, traces, strict=True)], pad)
    batch, width = input_ids.shape
    seed = state.prefixes.seed(traces[0].tokens[: traces[0].prompt_len]) if with_draft and batch == 1 else 0
    target = TraceCache([target_answers(r, pad) for r in rows], vocab.size)
    proposers: list[Proposer] = []
    draft_cache = None
    if with_draft:
        draft_cache = TraceCache([draft_answers(t.prompt_len, vocab.encode(t.draft_next), t.draft_q) for t in traces],
                                 vocab.size, [seed] * batch)
        proposers.append(DraftModelProposer(None, batch, None, False, pad, tuple(eos.tolist()), cache=draft_cache))
    if "lookup" in costless:
        proposers.append(PromptLookupProposer(max_ngram=config.prompt_lookup_max_ngram))
    if "suffix" in costless:
        if state.suffixes is None:
            state.suffixes = _memory(suffix)
        proposers.append(_suffix(state.suffixes, [t.prompt_len for t in traces], suffix))
    n_max = config.max_speculative_tokens + 1
    drafters = tuple((p.name, memory_key(p, VirtualDraft)) for p in proposers)
    learned = state.learned
    controller = SPECULATION_MODES[config.speculation].build(PolicyInputs(
        config, functools.cache(lambda b: clock.profile.cost_table(b, width, n_max)), batch, drafters,
        Learned(learned.calibrators, learned.matches)))
    max_length = width + max(t.max_new_tokens for t in traces)
    settings = DecodeSettings(LogitsProcessorList(), _stopping(eos, max_length), max_length, False, config.k_max, pad)
    result = speculative_decode(None, input_ids, valid.long(), proposers, controller, settings, cache=target)
    if draft_cache is not None and batch == 1:
        state.prefixes.remember(traces[0].tokens, int(draft_cache.lengths[0]), seed)
    if state.suffixes is not None:
        for i, t in enumerate(traces):
            out = result.sequences[i, width : width + result.stats.row_tokens[i]].tolist()
            state.suffixes.remember(rows[i][: t.prompt_len].tolist(), out)
    time_ms = _price(clock, traces, target.log, draft_cache.log if draft_cache is not None else [], result.stats)
    return _run(traces, method, result.stats, time_ms, seed, _matches(result.sequences, width, traces, vocab))


def suffix_runs(trace: Trace, memory: SuffixMemory, suffix: dict, k_max: int = K_MAX) -> list[int]:
    """runs[j-1] for generated tokens j = 1..n-1 (as ``bench_oracle.lookup_runs``): leading tokens of the
    suffix drafter's k_max-token proposal that equal the real next tokens, ``memory`` as it stands."""
    proposer = _suffix(memory, [trace.prompt_len], suffix)
    tokens, runs = torch.tensor(trace.tokens), []
    for pos in range(trace.prompt_len + 1, tokens.shape[0]):
        guess = torch.tensor(proposer.draft(tokens[:pos], trace.prompt_len, k_max).tokens, dtype=torch.long)
        truth = tokens[pos : pos + guess.shape[0]]
        same = (guess[: truth.shape[0]] == truth).int()
        runs.append(int(same.cumprod(0).sum()) if same.numel() else 0)
    return runs


def oracles(traces: Sequence[Trace], clock: Clock, suffix: dict) -> list[dict[str, float]]:
    """Per trace, oracle tokens/s per drafter set: draft, lookup, suffix and their unions."""
    prefixes, memory, out = PrefixMemory(), _memory(suffix), []
    for t in traces:
        seed = prefixes.seed(t.tokens[: t.prompt_len])
        prefixes.remember(t.tokens, len(t.tokens), seed)
        mid = t.prompt_len + t.new_tokens // 2
        verify = lambda cols, mid=mid: clock.verify_ms(Forward(1, cols, mid))  # noqa: E731
        lookup = OracleDrafter(tuple(lookup_runs(torch.tensor([t.tokens]), t.prompt_len, K_MAX)))
        sfx = OracleDrafter(tuple(suffix_runs(t, memory, suffix)))
        model = OracleDrafter(tuple(agreement_runs(t.draft_agreement())), clock.draft_ms(Forward(1, 1, mid)),
                              clock.draft_ms(Forward(1, t.prompt_len - seed, 0)) if t.prompt_len > seed else 0.0)
        sets = {"draft+lookup": [model, lookup], "draft+suffix": [model, sfx], "lookup": [lookup],
                "suffix": [sfx], "lookup+suffix": [lookup, sfx], "all": [model, lookup, sfx]}
        out.append({name: 1000.0 * t.new_tokens / (t.prefill_ms + oracle_schedule(d, K_MAX, verify).time_ms)
                    for name, d in sets.items()})
        memory.remember(t.tokens[: t.prompt_len], t.tokens[t.prompt_len :])
    return out


ORACLE_OF = {"adaptive": "draft+lookup", "adaptive/suffix": "draft+suffix", "adaptive/both": "all",
             "adaptive-lookup": "lookup", "adaptive-lookup/suffix": "suffix", "adaptive-lookup/both": "lookup+suffix"}


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def _summary(runs: Sequence[ReplayRun], plain: Sequence[ReplayRun], picked: Sequence[int],
             bound: list[dict[str, float]] | None, method: str) -> dict:
    ratio = [runs[i].tokens_per_s / plain[i].tokens_per_s for i in picked]
    drafters: dict[str, int] = {}
    for i in picked:
        for d, c in runs[i].drafter_histogram.items():
            drafters[d] = drafters.get(d, 0) + c
    steps = sum(drafters.values())
    row = {"speedup": round(geomean(ratio), 4),
           "total_time_speedup": round(sum(plain[i].time_ms for i in picked)
                                       / sum(runs[i].time_ms for i in picked), 4),
           "tokens_per_step": round(sum(runs[i].new_tokens for i in picked) / max(1, sum(runs[i].steps for i in picked)), 3),
           "step_share": {d: round(c / steps, 3) for d, c in sorted(drafters.items())},
           "all_match_traces": all(runs[i].matches_trace for i in picked)}
    if bound is not None:
        tps = [runs[i].tokens_per_s for i in picked]
        row["pct_oracle"] = round(100 * geomean([x / bound[i][ORACLE_OF[method]] for x, i in zip(tps, picked)]), 1)
        row["pct_oracle_all"] = round(100 * geomean([x / bound[i]["all"] for x, i in zip(tps, picked)]), 1)
    return row


def run_workload(traces: Sequence[Trace], methods: Sequence[str], clock: Clock, suffix: dict,
                 with_oracle: bool = True, subsets: dict[str, Sequence[int]] | None = None) -> dict:
    """Replay every method over ``traces`` in order (fresh state per method); summarise each subset of
    requests (indices; default: all) by geomean speedup vs plain, % of its oracle, % of the all-drafter oracle."""
    vocab = Vocab([i for t in traces for i in (*t.tokens, *t.draft_next, *t.eos)])
    plain = [plain_run([t], clock) for t in traces]
    bound = oracles(traces, clock, suffix) if with_oracle else None
    subsets = subsets or {"all": range(len(traces))}
    out = {name: {"prompts": len(picked), "methods": {}} for name, picked in subsets.items()}
    for m in methods:
        state = State()
        runs = [replay_request([t], m, state, clock, vocab, suffix) for t in traces]
        for name, picked in subsets.items():
            row = out[name]["methods"][m] = _summary(runs, plain, list(picked), bound, m)
            print(f"  {name:8s} {m:24s} {json.dumps(row)}", flush=True)
    if bound is not None:
        for name, picked in subsets.items():
            out[name]["oracle_speedup"] = {f: round(geomean([bound[i][f] / plain[i].tokens_per_s for i in picked]), 4)
                                           for f in bound[0]}
    return out if len(subsets) > 1 else out[next(iter(subsets))]


def stock_check(traces: Sequence[Trace], clock: Clock) -> dict:
    """The stock replay's speedups for the current methods (per-request vocabularies), to check that one
    vocabulary for the run changes nothing."""
    result = replay_all(traces, ["plain", "adaptive", "adaptive-lookup"], clock)
    plain = {r.question_id: r.tokens_per_s for r in result.runs if r.method == "plain"}
    return {m: round(geomean([r.tokens_per_s / plain[r.question_id] for r in result.runs if r.method == m]), 4)
            for m in ("adaptive", "adaptive-lookup")}


TUNE_GRID = {  # name → changes to DEFAULT_SUFFIX
    "vllm defaults": {},
    "prompts in memory": {"prompts": True},
    "min_token_prob=0.05": {"min_token_prob": 0.05},
    "min_token_prob=0.2": {"min_token_prob": 0.2},
    "spec_factor=2": {"spec_factor": 2.0},
    "spec_offset=2": {"spec_offset": 2.0},
    "max_depth=32": {"max_depth": 32},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tune", action="store_true", help="also replay the tuning grid on the tune split")
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    start = time.time()
    clock = Clock(load_profile(PROFILE))
    every = load_traces("benchmarks/traces")
    pick = lambda split, source: [t for t in every if split in ("all", t.split) and t.source == source]  # noqa: E731
    out: dict = {"profile": PROFILE, "clock": "virtual (cost profile; no wall-clock timing)", "suffix": DEFAULT_SUFFIX}
    if args.tune:
        tune = pick("tune", "spec_bench") + pick("tune", "code")
        grid = {}
        for name, change in TUNE_GRID.items():
            print(f"tune: {name}", flush=True)
            grid[name] = run_workload(tune, ["adaptive/suffix", "adaptive-lookup/suffix"], clock,
                                      {**DEFAULT_SUFFIX, **change}, with_oracle=False)
        out["tune_grid"] = grid
        print("tune: every method (suffix at vLLM's defaults)", flush=True)
        out["tune_methods"] = run_workload(tune, list(METHODS), clock, DEFAULT_SUFFIX, with_oracle=False)
    suffix = DEFAULT_SUFFIX
    methods = ["adaptive", "adaptive/suffix", "adaptive/both", "adaptive-lookup", "adaptive-lookup/suffix",
               "adaptive-lookup/both"]
    held = pick("held-out", "spec_bench")
    code = pick("all", "code")
    print("stock replay check (held-out)", flush=True)
    out["stock_check_held_out"] = stock_check(held, clock)
    print(f"  {out['stock_check_held_out']}")
    work = {}
    print("spec_bench held-out", flush=True)
    work["spec_bench_held_out"] = run_workload(held, methods, clock, suffix)
    print("code held-out", flush=True)
    work["code_held_out"] = run_workload(pick("held-out", "code"), methods, clock, suffix)
    print("code all (16, in order)", flush=True)
    work["code_all"] = run_workload(code, methods, clock, suffix)
    twice = [t for t in code for _ in range(2)]
    print("session (synthetic): each code trace twice in a row", flush=True)
    work["session_code_twice"] = run_workload(twice, methods, clock, suffix, subsets={
        "repeats": range(1, len(twice), 2), "firsts": range(0, len(twice), 2), "all": range(len(twice))})
    out["workloads"] = work
    alone = {**suffix, "max_requests": 0}  # ablation: no earlier requests (the current one's tokens only)
    ablation = {}
    for name, traces in (("spec_bench_held_out", held), ("code_all", code), ("session_code_twice_repeats", twice)):
        print(f"ablation, suffix without memory: {name}", flush=True)
        only = {"repeats": range(1, len(twice), 2)} if name.startswith("session") else None
        ablation[name] = run_workload(traces, ["adaptive/suffix", "adaptive-lookup/suffix"], clock, alone,
                                      with_oracle=False, subsets=only)
    out["ablation_no_memory"] = ablation
    out["elapsed_s"] = round(time.time() - start, 1)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
