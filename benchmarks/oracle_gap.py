"""How much of the hindsight oracle can a causal controller reach with this pair's features? (issue 25)

The oracle (``hf-adaspec replay``'s "oracle hybrid") picks every step's drafter and k knowing how many tokens
each proposal will have accepted. A causal controller knows only what predicts acceptance: prompt lookup's and
suffix drafting's match length, the draft's confidences q(x) of the tokens it has drafted, and what it learned
from earlier steps and requests. This script replays ``adaptive`` through the library's own controller and
engine (``replay_request``) with its acceptance models given information no causal controller has, to see
whether more or better statistics would close the gap to the oracle:

- ``shipped``: the models as the library learns them (reproduces ``hf-adaspec replay``'s adaptive figures).
- ``peek``: the draft's confidences of its next proposal known before it is paid for: P_j = the learned
  calibration of Π q over the next j tokens of the target's output (the draft's q along that output, from the
  trace), instead of the running mean c̄^j.
- ``peek+fitted-draft``: as ``peek``, with the draft's calibration fitted on the request itself (every start
  position, up to 8 tokens, successes until the first disagreement; no optimism bonus, no learning) and c̄ the
  request's mean q: a perfectly calibrated draft for this request.
- ``peek+fitted-all``: also prompt lookup's and suffix drafting's per-match-length tables fitted on the request
  itself (a first pass over the same request with tables that do not decay, frozen for the second pass; the
  first pass's suffix memory and draft prefixes are discarded).
- ``known-draft``: a perfect predictor of the draft: P_j = 1 for the j ≤ r tokens the target will accept from
  this position (r from the trace), 0 beyond, before drafting and in the stop rule; the costless drafters as
  shipped. What the sharpest possible acceptance predictor for the draft alone would buy.

It also reports how well the draft's own distribution ranks its tokens' acceptance: the AUC of q1 (the draft's
probability of its argmax) and of the margin q1 − q2 (``results/draft_top2.json``, when present) for "the
draft's argmax is the target's token", over every generated position of the Spec-Bench traces.

None of these is a bound on every causal policy (no such bound is computable); each hands the controller
information or calibration it cannot have. If none gets near the oracle, the oracle's edge is the realisation
of each proposal (which tokens the target will take), not statistics a better learner could recover.

Run: python benchmarks/oracle_gap.py [--profile P] (about 4 minutes)
Writes benchmarks/results/oracle_gap.json; last stdout line: one JSON object.
"""

import argparse
import bisect
import contextlib
import copy
import json
import math
import statistics
from pathlib import Path

from hf_adaspec.costs.profile import load_profile
from hf_adaspec.policy import modes
from hf_adaspec.policy.confidence import ConfidenceCalibrator, RunningMean
from hf_adaspec.policy.controller import AdaptiveController, ConfidenceAcceptance, StepOutcome
from hf_adaspec.policy.match import MatchAcceptance, MatchTable
from hf_adaspec.tools.replay import Clock, MethodState, replay_request
from hf_adaspec.tools.replay_report import replay_all
from hf_adaspec.tools.trace import Trace, load_traces

PROFILE = Path("model_cards/qwen2.5-coder-1.5b_0.5b/profile.json")
OUT = Path("benchmarks/results/oracle_gap.json")
TOP2 = Path("benchmarks/results/draft_top2.json")
K_MAX = 8
VARIANTS = ("shipped", "peek", "peek+fitted-draft", "peek+fitted-all", "known-draft")
WORKLOADS = (("held-out", "spec_bench"), ("tune", "spec_bench"), ("all", "code"))


class Cursor:
    """The request being replayed and how many of its tokens are emitted (the first comes from the prefill)."""

    def __init__(self) -> None:
        self.trace: Trace | None = None
        self.position = 1


class PeekConfidence(ConfidenceAcceptance):
    """The draft priced by the q of its next proposal along the target's output, before drafting it."""

    def __init__(self, batch: int, calibrator: ConfidenceCalibrator, cursor: Cursor, frozen: bool) -> None:
        super().__init__(batch, calibrator)
        self.cursor, self.frozen = cursor, frozen
        if frozen:
            self.c_bar = [RunningMean(calibrator.token_mean, 1e12) for _ in range(batch)]

    def path(self, i: int, upper: int) -> tuple[float, ...]:
        q, start, out, c = self.cursor.trace.draft_q, self.cursor.position, [], 1.0
        for j in range(upper):
            c *= q[min(start + j, len(q) - 1)]
            out.append(self.calibrator.predict(c))
        return tuple(out)

    def observe(self, i: int, drafted: int, accepted: int, confidences: tuple[float, ...]) -> None:
        if not self.frozen:
            super().observe(i, drafted, accepted, confidences)


class KnownDraft(ConfidenceAcceptance):
    """The draft priced by what the target will accept: P_j = 1 for j ≤ r (the agreement run from the cursor)."""

    def __init__(self, batch: int, calibrator: ConfidenceCalibrator, cursor: Cursor) -> None:
        super().__init__(batch, calibrator)
        self.cursor = cursor

    def run(self) -> int:
        """Tokens the target will accept of a draft proposal made at the cursor."""
        t, j = self.cursor.trace, self.cursor.position
        truth = t.tokens[t.prompt_len:]
        r = 0
        while j + r < t.new_tokens and t.draft_next[j + r] == truth[j + r]:
            r += 1
        return r

    def path(self, i: int, upper: int) -> tuple[float, ...]:
        r = self.run()
        return tuple(1.0 if j < r else 0.0 for j in range(upper))

    def drafted(self, confidences: tuple[float, ...]) -> list[float]:
        r = self.run()
        return [1.0 if j < r else 0.0 for j in range(len(confidences))]

    def next_prob(self, i: int, confidences: tuple[float, ...]) -> float:
        return 1.0 if len(confidences) < self.run() else 0.0


class FrozenMatch(MatchAcceptance):
    """A match-length table that no longer learns."""

    def observe(self, i: int, compared: int, accepted: int, confidences: tuple[float, ...]) -> None:
        """Frozen: nothing learned."""


class CursorController(AdaptiveController):
    """``AdaptiveController`` that advances the cursor by the tokens each step emitted."""

    def __init__(self, cursor: Cursor, *args) -> None:
        super().__init__(*args)
        self.cursor = cursor

    def observe(self, outcome: StepOutcome) -> None:
        self.cursor.position += sum(n + 1 for n in outcome.accepted)
        super().observe(outcome)


def fitted_calibrator(trace: Trace) -> ConfidenceCalibrator:
    """The draft's calibration fitted on ``trace`` itself: from every position, the prefix confidences of up
    to ``K_MAX`` tokens along the target's output, accepted until the first disagreement."""
    cal = ConfidenceCalibrator(prior_strength=1e-3, token_mean=statistics.fmean(trace.draft_q), optimism=0.0)
    truth, n = trace.tokens[trace.prompt_len:], trace.new_tokens
    for i in range(1, n):
        qs, accepted = [], 0
        for j in range(i, min(n, i + K_MAX)):
            qs.append(trace.draft_q[j])
            if trace.draft_next[j] != truth[j]:
                break
            accepted += 1
        cal.update(qs, accepted)
    return cal


class Builder:
    """The ``adaptive`` mode's controller for one variant; ``tables`` = the first pass's fitted tables."""

    def __init__(self, variant: str, cursor: Cursor) -> None:
        self.variant, self.cursor = variant, cursor
        self.calibrator: ConfidenceCalibrator | None = None
        self.tables: dict[str, MatchTable] | None = None  # None: the learned ones
        self.frozen_tables = False

    def __call__(self, inputs: modes.PolicyInputs) -> AdaptiveController:
        models, paid = [], []
        for name, key in inputs.drafters:
            if name == "draft_model":
                fitted = self.variant in ("peek+fitted-draft", "peek+fitted-all")
                cal = self.calibrator if fitted else inputs.learned.calibrators.calibrator_for(key)
                if self.variant == "known-draft":
                    models.append(KnownDraft(inputs.batch, cal, self.cursor))
                elif self.variant == "shipped":
                    models.append(ConfidenceAcceptance(inputs.batch, cal))
                else:
                    models.append(PeekConfidence(inputs.batch, cal, self.cursor, fitted))
            elif self.tables is None:
                models.append(MatchAcceptance(inputs.batch, inputs.learned.matches.table_for(key)))
            else:
                table = self.tables.setdefault(name, MatchTable(strength=0.5, decay=1.0))
                models.append((FrozenMatch if self.frozen_tables else MatchAcceptance)(inputs.batch, table))
            paid.append(name == "draft_model")
        return CursorController(self.cursor, inputs.costs_for, models, paid)


@contextlib.contextmanager
def adaptive_mode(build):
    """The registry's ``adaptive`` entry built by ``build`` for the duration (restored after)."""
    shipped = modes.SPECULATION_MODES["adaptive"]
    modes.SPECULATION_MODES["adaptive"] = modes.SpeculationMode(build, shipped.lookup_with_draft, shipped.suffix)
    try:
        yield
    finally:
        modes.SPECULATION_MODES["adaptive"] = shipped


def replay_variant(traces: list[Trace], variant: str, clock: Clock) -> list[float]:
    """Predicted ms of each request under ``variant``, learning across the requests in order."""
    cursor, state, times = Cursor(), MethodState(), []
    build = Builder(variant, cursor)
    with adaptive_mode(build):
        for t in traces:
            cursor.trace = t
            if variant.startswith("peek+fitted"):
                build.calibrator = fitted_calibrator(t)
            if variant == "peek+fitted-all":
                build.tables, build.frozen_tables, cursor.position = {}, False, 1
                replay_request([t], "adaptive", copy.deepcopy(state), clock)  # fits the tables on t
                build.frozen_tables = True
            cursor.position = 1
            run = replay_request([t], "adaptive", state, clock)
            if not run.matches_trace:
                raise RuntimeError(f"{variant} on {t.question_id}: output differs from the trace")
            times.append(run.time_ms)
    return times


def auc(scores: list[float], labels: list[bool]) -> float:
    """Area under the ROC curve: P(score of a positive > score of a negative), ties counted half."""
    neg = sorted(s for s, y in zip(scores, labels) if not y)
    pos = [s for s, y in zip(scores, labels) if y]
    wins = sum(bisect.bisect_left(neg, p) + 0.5 * (bisect.bisect_right(neg, p) - bisect.bisect_left(neg, p)) for p in pos)
    return wins / (len(pos) * len(neg))


def draft_auc(traces: list[Trace]) -> dict:
    """AUC of q1 (and of q1 − q2 where ``TOP2`` exists) for the draft's argmax equalling the target's token."""
    top2 = json.loads(TOP2.read_text())["traces"] if TOP2.exists() else {}
    q1, margin, agree, agree2 = [], [], [], []
    for t in traces:
        truth = t.tokens[t.prompt_len:]
        for j in range(1, t.new_tokens):
            q1.append(t.draft_q[j])
            agree.append(t.draft_next[j] == truth[j])
            if str(t.question_id) in top2:
                row = top2[str(t.question_id)]
                margin.append(row["q1"][j] - row["q2"][j])
                agree2.append(row["first"][j] == truth[j])
    out = {"positions": len(q1), "agreement": round(sum(agree) / len(agree), 4), "auc_q1": round(auc(q1, agree), 4)}
    if margin:
        out["auc_q1_minus_q2"] = round(auc(margin, agree2), 4)
    return out


def _geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values))


def table(traces: list[Trace], plain_ms: list[float], oracle: list[float], times: list[float]) -> dict:
    """Per category and overall: geomean speedup vs plain and geomean % of the hybrid oracle's tokens/s."""
    out = {}
    for cat in sorted({t.category for t in traces}) + ["overall"]:
        idx = [i for i, t in enumerate(traces) if cat in ("overall", t.category)]
        out[cat] = {"speedup": round(_geomean([plain_ms[i] / times[i] for i in idx]), 4),
                    "pct_oracle": round(100 * _geomean([1000 * traces[i].new_tokens / times[i] / oracle[i]
                                                        for i in idx]), 1)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=Path, default=PROFILE)
    parser.add_argument("--traces", type=Path, default=Path("benchmarks/traces"))
    args = parser.parse_args()
    clock = Clock(load_profile(args.profile))
    results = {}
    for split, workload in WORKLOADS:
        traces = [t for t in load_traces(args.traces) if split in ("all", t.split) and workload == t.source]
        base = replay_all(traces, ["plain"], clock)
        plain_ms = [r.time_ms for r in base.replays]
        oracle = [o.tokens_per_s["hybrid"] for o in base.oracles]
        key = f"{workload}:{split}"
        results[key] = {v: table(traces, plain_ms, oracle, replay_variant(traces, v, clock)) for v in VARIANTS}
        for v in VARIANTS:
            row = results[key][v]
            worst = min((c for c in row if c != "overall"), key=lambda c: row[c]["pct_oracle"])
            print(f"{key:20s} {v:18s} speedup {row['overall']['speedup']:.3f}x  {row['overall']['pct_oracle']:5.1f}% "
                  f"of oracle  (lowest: {worst} {row[worst]['pct_oracle']:.1f}%)", flush=True)
    ranking = draft_auc([t for t in load_traces(args.traces) if t.source == "spec_bench"])
    print(f"draft's acceptance ranked by its own distribution (Spec-Bench): {ranking}")
    OUT.write_text(json.dumps({"kind": "replay prediction (virtual clock, not measured)", "profile": str(args.profile),
                               "results": results, "draft_auc": ranking}, indent=1) + "\n")
    print(json.dumps({"output": str(OUT), **{k: {v: r[v]["overall"]["pct_oracle"] for v in VARIANTS}
                                            for k, r in results.items()}}))


if __name__ == "__main__":
    main()
