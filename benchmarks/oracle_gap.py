"""How close to the oracle a policy can come without seeing the future, and what prompt lookup's match
length says about its acceptance.

Per Spec-Bench prompt: the target's greedy output (plain decoding), the draft's teacher-forced
agreement runs (``bench_oracle.draft_agreement``), and, costed with the cost table the controllers use
at the prompt's length (the pair's profile), decode time only (the prefill is the same for all):
- the draft-model oracle (``oracle.oracle_schedule``): each step drafts exactly the run that will be
  accepted; the draft's prompt ingest is paid when the schedule drafts at all;
- the best fixed k in hindsight: the k in 1..8, or plain decoding, that is fastest on this very output
  when every step drafts k and keeps the accepted prefix. It knows the prompt's best k, but not where
  the rejections fall.
The ratio of the two shows how much of the oracle's gain comes from knowing each rejection in advance.
Prompt lookup (n-grams of 3 down to 1, ``proposers.prompt_lookup``): per matched n-gram length n, the
positions with a match, the share whose first proposed token is right, and the i.i.d. acceptance rate
α = accepted / (accepted + rejections) of proposals of up to 8 tokens.

Run: python benchmarks/oracle_gap.py [--per-category 5] [--max-new-tokens 64]
Last stdout line: one JSON object.
"""

import argparse
import collections
import json
import math
import sys
from pathlib import Path

import torch

import hf_adaspec
from hf_adaspec.bench import load_prompts
from hf_adaspec.bench_oracle import draft_agreement
from hf_adaspec.costs import CostCache, CostTable
from hf_adaspec.oracle import OracleDrafter, agreement_runs, oracle_schedule
from hf_adaspec.proposers.prompt_lookup import find_continuation

K_MAX = 8
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


def fixed_k_ms(runs: list[int], k: int, costs: CostTable, setup_ms: float) -> float:
    """Decode time (ms) of drafting k at every step over the tokens ``runs`` covers (runs[i]: the draft's
    agreement run at position i), each step keeping min(run, k) drafts plus the bonus token."""
    i, total, n = 0, setup_ms if k else 0.0, len(runs)
    while i < n:
        step_k = min(k, n - i - 1)
        total += step_k * costs.draft_ms + costs.t_verify(step_k + 1)
        i += min(runs[i], step_k) + 1
    return total


def matched_ngram(tokens: torch.Tensor, max_ngram: int = 3) -> int:
    """Length n of the longest suffix n-gram (≤ max_ngram) seen earlier in tokens [T]; 0 if none."""
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), 0, -1):
        if (tokens[: length - 1].unfold(0, n, 1) == tokens[length - n :]).all(dim=-1).any():
            return n
    return 0


def lookup_by_ngram(tokens: torch.Tensor, prompt_len: int, tally: dict) -> None:
    """Add, per matched n, [positions, first token right, accepted tokens, rejections] over the output."""
    for pos in range(prompt_len + 1, tokens.shape[0]):
        guess = find_continuation(tokens[:pos], 3, 1, K_MAX)
        truth = tokens[pos : pos + guess.shape[0]]
        if not guess.numel():
            continue
        same = (guess[: truth.shape[0]] == truth).int()
        run = int(same.cumprod(0).sum())
        row = tally[matched_ngram(tokens[:pos])]
        row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + (run > 0), row[2] + run, row[3] + (run < guess.shape[0])


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-category", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=Path, default=SPEC_BENCH)
    args = parser.parse_args()
    target = hf_adaspec.load(hf_adaspec.DEFAULT_TARGET)
    draft = hf_adaspec.load(hf_adaspec.DEFAULT_DRAFT, quantize_lm_head=True).model
    rows, tally = [], collections.defaultdict(lambda: [0, 0, 0, 0])
    for prompt in load_prompts(args.prompts, args.per_category):
        msgs = [{"role": "user", "content": prompt.text}]
        inputs = target.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                                      return_dict=True)
        prompt_len = inputs["input_ids"].shape[1]
        sequence = target.model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        costs = CostCache().load_or_measure(target.model, draft, K_MAX + 1, lambda m: print(m, file=sys.stderr),
                                            context=prompt_len)
        runs = agreement_runs(draft_agreement(draft, sequence, prompt_len))
        if len(runs) < 2:
            continue
        setup = prompt_len * costs.draft_catchup_ms
        oracle = oracle_schedule([OracleDrafter(tuple(runs), costs.draft_ms, setup)], K_MAX, costs.t_verify).time_ms
        plain = len(runs) * costs.t_verify(1)
        best = min(fixed_k_ms(runs, k, costs, setup) for k in range(K_MAX + 1))
        rows.append({"id": prompt.question_id, "category": prompt.category, "oracle_speedup": plain / oracle,
                     "hindsight_k_speedup": plain / best, "hindsight_over_oracle": oracle / best})
        lookup_by_ngram(sequence[0].cpu(), prompt_len, tally)
    by_cat = collections.defaultdict(list)
    for row in rows:
        by_cat[row["category"]].append(row)
    table = {cat: {key: round(_geomean([r[key] for r in rs]), 3)
                   for key in ("oracle_speedup", "hindsight_k_speedup", "hindsight_over_oracle")}
             for cat, rs in [*by_cat.items(), ("overall", rows)]}
    for cat, cell in table.items():
        print(f"{cat:16s} oracle {cell['oracle_speedup']:.2f}x  best fixed k in hindsight "
              f"{cell['hindsight_k_speedup']:.2f}x  = {100 * cell['hindsight_over_oracle']:.0f}% of the oracle")
    lookup = {n: {"positions": t[0], "first_token_right": round(t[1] / t[0], 3),
                  "alpha": round(t[2] / (t[2] + t[3]), 3)} for n, t in sorted(tally.items())}
    print(json.dumps({"prompts": len(rows), "table": table, "lookup_by_ngram": lookup}))


if __name__ == "__main__":
    main()
