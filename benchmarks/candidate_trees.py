"""Would candidate trees pay (issue 26 item 3)? Each step of the replayed ``adaptive`` policy, with one or more
extra branches verified in the same target forward, priced by the cost profile.

Under greedy decoding what a branch would have added is exact from the traces: a proposal is accepted as far as
it equals the target's output, and the draft's top-2 after every prefix of that output (``draft_top2.py``) says
whether its second choice was the target's token. For every step of ``hf-adaspec replay``'s adaptive run
(position p, drafter, k, accepted a) the trees tried are:

- ``draft-sibling-m``: a draft step's k tokens plus the draft's second choice at the m least confident of its
  k positions (q1 from the trace; past the first rejection q1 is the draft's along the target's path, the
  replay's approximation). It gains one token when the rejection falls on such a position and the second
  choice is the target's token (the sibling is accepted and the bonus follows it). Costs m verified tokens.
- ``draft-sibling-gated``: siblings where the draft's own estimate that one is taken, P(reach j)·q2[j] with
  P(reach j) = Π q1 before j, times τ exceeds the verified token it adds (a causal rule).
- ``draft-sibling-1+b``: the sibling at the least confident position continued by b draft tokens; when the
  sibling is accepted the continuation is the draft's greedy run along the target's output, so it adds
  1 + min(b, run) tokens. Costs b draft tokens and 1 + b verified tokens.
- ``costless-union``: a step's proposal plus the other drafters' costless proposals (prompt lookup, suffix
  drafting, with the replay's memory of earlier requests) to the same k, merged as a prefix tree. Gains
  max(0, best other run − a); costs the verified tokens the union adds.

A step's time changes by the added cost (the profile's verification of the wider forward minus the chain's,
plus draft tokens) and, to first order, by −τ per added token, τ = the run's decode time per token. That is a
prediction, not a replay of a tree engine: the later schedule is assumed unchanged. "always" adds the branch on
every eligible step; "hindsight" only where it gains (an upper bound for any rule deciding when to branch).
Projection "flat": the same profile with verification of up to 64 tokens costing what one token costs (a
machine where a forward is flat in width; draft costs as here); the baseline is replayed under it too.

Run: python benchmarks/candidate_trees.py [--profile P] (needs benchmarks/results/draft_top2.json)
Writes benchmarks/results/candidate_trees.json; last stdout line: one JSON object.
"""

import argparse
import json
import statistics
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from hf_adaspec.costs.profile import Profile, load_profile
from hf_adaspec.proposers.prompt_lookup import find_continuation
from hf_adaspec.proposers.suffix import SuffixMemory, SuffixProposer
from hf_adaspec.tools.oracle import agreement_runs
from hf_adaspec.tools.replay import Clock, MethodState, replay_request
from hf_adaspec.tools.trace import Trace, load_traces

TOP2 = Path("benchmarks/results/draft_top2.json")
OUT = Path("benchmarks/results/candidate_trees.json")
FLAT_WIDTH = 64
K_MAX = 8
SHAPES = ("draft-sibling-1", "draft-sibling-2", "draft-sibling-all", "draft-sibling-gated", "draft-sibling-1+1", "draft-sibling-1+2",
          "draft-sibling-1+4", "costless-union")


class FlatProfile(Profile):
    """``Profile`` with verification flat in width up to ``FLAT_WIDTH`` tokens (a projection)."""

    def verify_ms(self, batch: int, context: int, new_tokens: int, forced: str | None = None) -> float:
        return super().verify_ms(batch, context, max(1, new_tokens - FLAT_WIDTH + 1), forced)


@dataclass
class Tally:
    """Per tree shape: eligible steps, steps that gain, tokens added, ms added (always / hindsight)."""

    steps: int = 0
    gaining: int = 0
    tokens: int = 0
    always_ms: float = 0.0
    hindsight_ms: float = 0.0

    def add(self, gain: int, cost_ms: float, tau: float) -> None:
        self.steps += 1
        self.gaining += gain > 0
        self.tokens += gain
        self.always_ms += cost_ms - gain * tau
        self.hindsight_ms += min(0.0, cost_ms - gain * tau)


def _run_from(runs: list[int], j: int) -> int:
    """Agreement run of the draft starting at generated token j (0 past the end)."""
    return runs[j - 1] if 1 <= j <= len(runs) else 0


def _matched(proposal: list[int], truth: list[int]) -> int:
    n = 0
    for a, b in zip(proposal, truth, strict=False):
        if a != b:
            break
        n += 1
    return n


def _costless(tokens: torch.Tensor, prompt_len: int, memory: SuffixMemory, k: int) -> dict[str, list[int]]:
    """Prompt lookup's and suffix drafting's proposals (first k tokens) after ``tokens`` [T]."""
    lookup = find_continuation(tokens, 3, 1, K_MAX).tolist()
    suffix = list(SuffixProposer(memory, [prompt_len]).draft(tokens, prompt_len, K_MAX).tokens)
    return {"prompt_lookup": lookup[:k], "suffix": suffix[:k]}


def _costless_shape(s, truth: list[int], proposals: dict[str, list[int]], verify, tau: float, tally: Tally) -> None:
    """The step's proposal plus the other costless proposals as branches of one prefix tree."""
    main = proposals.get(s.drafter, truth[: s.accepted] + [-1])[: s.k]
    others = [c for name, c in proposals.items() if name != s.drafter and c and c != main]
    if not others:
        return
    gain = max(0, max(_matched(c, truth) for c in others) - s.accepted)
    nodes = {tuple(main[:i]) for i in range(1, len(main) + 1)}
    added = {tuple(c[:i]) for c in others for i in range(1, len(c) + 1)} - nodes
    tally.add(gain, verify(len(added)) if added else 0.0, tau)


def analyse(trace: Trace, top2: dict, run, memory: SuffixMemory, clock: Clock, tallies: dict[str, Tally]) -> None:
    """Add one replayed request's steps to ``tallies``."""
    out = list(trace.tokens[trace.prompt_len :])
    n, p0 = len(out), trace.prompt_len
    runs = agreement_runs(trace.draft_agreement())
    decode_ms = run.time_ms - trace.prefill_ms
    tau = decode_ms / max(1, n - 1)
    seq = torch.tensor(trace.tokens)
    p = 1  # token 0 comes from the prefill
    for s in sorted(run.stats.steps, key=lambda s: s.step):
        if s.k > 0:
            ctx = p0 + p
            verify = lambda extra, s=s, ctx=ctx: (clock.profile.verify_ms(1, ctx, s.k + 1 + extra)  # noqa: E731
                                                  - clock.profile.verify_ms(1, ctx, s.k + 1))
            truth = out[p : p + s.k]
            if s.drafter == "draft_model":
                _draft_shapes(s, p, _alternative(top2, trace.draft_next), runs, out, verify, clock.profile.draft_ms(1, ctx), tau, tallies)
            _costless_shape(s, truth, _costless(seq[:ctx], p0, memory, s.k), verify, tau, tallies["costless-union"])
        p += s.emitted
    memory.remember(trace.tokens[:p0], out)


def _alternative(top2: dict, draft_next: tuple[int, ...]) -> dict:
    """The draft's top-2 token that is not the trace's argmax (the argmax differs from this pass's at ~1% of
    positions, near-ties), its probability and the argmax's."""
    swap = [a != d for a, d in zip(top2["first"], draft_next, strict=True)]
    return {"alt": [f if w else s for f, s, w in zip(top2["first"], top2["second"], swap, strict=True)],
            "q_alt": [q1 if w else q2 for q1, q2, w in zip(top2["q1"], top2["q2"], swap, strict=True)],
            "q1": [q2 if w else q1 for q1, q2, w in zip(top2["q1"], top2["q2"], swap, strict=True)]}


def _draft_shapes(s, p: int, top2: dict, runs: list[int], out: list[int], verify, draft_ms: float, tau: float,
                  tallies: dict[str, Tally]) -> None:
    """The draft-sibling trees of one draft step at generated position p."""
    positions = list(range(p, p + s.k))
    by_conf = sorted(positions, key=lambda j: top2["q1"][j])
    reject = p + s.accepted if s.accepted < s.k else None
    alt_ok = reject is not None and reject < len(out) and top2["alt"][reject] == out[reject]
    for m, name in ((1, "draft-sibling-1"), (2, "draft-sibling-2"), (s.k, "draft-sibling-all")):
        chosen = by_conf[:m]
        tallies[name].add(int(alt_ok and reject in chosen), verify(len(chosen)), tau)
    reach, value = 1.0, {}
    for j in positions:  # P(the chain reaches j) · q2[j]: the draft's own estimate that a sibling at j is taken
        value[j] = reach * top2["q_alt"][j]
        reach *= top2["q1"][j]
    gated = []
    for j in sorted(positions, key=lambda j: -value[j]):
        if value[j] * tau <= verify(len(gated) + 1) - verify(len(gated)):
            break
        gated.append(j)
    tallies["draft-sibling-gated"].add(int(alt_ok and reject in gated), verify(len(gated)) if gated else 0.0, tau)
    for b in (1, 2, 4):
        gain = 1 + min(b, _run_from(runs, reject + 1)) if alt_ok and reject == by_conf[0] else 0
        tallies[f"draft-sibling-1+{b}"].add(gain, verify(1 + b) + b * draft_ms, tau)


def evaluate(traces: list[Trace], top2: dict, clock: Clock) -> dict:
    """Baseline adaptive replay and each tree's predicted change, over ``traces`` in order."""
    state, memory = MethodState(), SuffixMemory()
    tallies = {name: Tally() for name in SHAPES}
    adaptive_ms = plain_ms = 0.0
    for t in traces:
        run = replay_request([t], "adaptive", state, clock)
        assert run.matches_trace, t.question_id
        plain_ms += replay_request([t], "plain", state, clock).time_ms
        adaptive_ms += run.time_ms
        analyse(t, top2[str(t.question_id)], run, memory, clock, tallies)
    out = {"prompts": len(traces), "adaptive_speedup": round(plain_ms / adaptive_ms, 4), "shapes": {}}
    for name, tl in tallies.items():
        row = {f.name: round(getattr(tl, f.name), 1) for f in fields(tl)}
        row["always_speedup"] = round(plain_ms / (adaptive_ms + tl.always_ms), 4)
        row["hindsight_speedup"] = round(plain_ms / (adaptive_ms + tl.hindsight_ms), 4)
        out["shapes"][name] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, default=Path("model_cards/qwen2.5-coder-1.5b_0.5b/profile.json"))
    ap.add_argument("--traces", type=Path, default=Path("benchmarks/traces"))
    args = ap.parse_args()
    top2 = json.loads(TOP2.read_text())["traces"]
    profile = load_profile(args.profile)
    flat = FlatProfile(**{f.name: getattr(profile, f.name) for f in fields(profile)})
    every = [t for t in load_traces(args.traces) if str(t.question_id) in top2]
    sets = {"tune": [t for t in every if t.source == "spec_bench" and t.split == "tune"],
            "held-out": [t for t in every if t.source == "spec_bench" and t.split == "held-out"],
            "code": [t for t in every if t.source == "code"]}
    result = {name: {machine: evaluate(ts, top2, Clock(p)) for machine, p in (("cpu", profile), ("flat", flat))}
              for name, ts in sets.items() if ts}
    for name, by_machine in result.items():
        for machine, r in by_machine.items():
            print(f"\n{name} / {machine}: {r['prompts']} prompts, adaptive {r['adaptive_speedup']:.3f}x (replay prediction)")
            for shape, row in r["shapes"].items():
                print(f"  {shape:20s} steps {row['steps']:5.0f} gaining {row['gaining']:5.0f} +tokens {row['tokens']:5.0f}"
                      f"  always {row['always_speedup']:.3f}x  hindsight {row['hindsight_speedup']:.3f}x")
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    best = {f"{n}/{m}": max(r["shapes"].items(), key=lambda kv: kv[1]["always_speedup"])[0]
            for n, bm in result.items() for m, r in bm.items()}
    print(json.dumps({"best_always": best, "median_gain": statistics.median(
        r["shapes"][best[f"{n}/{m}"]]["always_speedup"] / r["adaptive_speedup"]
        for n, bm in result.items() for m, r in bm.items())}))


if __name__ == "__main__":
    main()
