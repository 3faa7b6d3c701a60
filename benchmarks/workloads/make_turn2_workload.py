"""Build the Spec-Bench second-turn workload: the conversation so far in the prompt.

Spec-Bench (Xia et al. 2024, Apache-2.0) asks the MT-Bench categories a second question about the
model's first answer. For every first-turn trace in ``benchmarks/traces`` whose question has a second
turn, a row holds the first turn and the target's own greedy answer to it (decoded from the trace,
special tokens dropped; 256 new tokens at most, so a long answer is cut as the model left it) as
``history`` and the second turn as ``turns``. Question ids are the first turn's + 20000, so they keep
its parity (``split_of``: even = tune, odd = held-out) and never collide with first-turn traces.
Rows are ordered by id within each category, as in Spec-Bench.

``--sessions`` writes ``spec_bench_sessions.jsonl`` instead: each second-turn row preceded by its first
turn (same category), so ``hf-adaspec bench``, which runs a category's rows in file order and keeps each
method's learned state and the draft's prefix store across requests, runs turn 1 and then turn 2 as a
session (``--per-category 2`` takes one session per category).

Run: python benchmarks/workloads/make_turn2_workload.py [--questions ../shared/data/spec_bench/question.jsonl]
     python benchmarks/workloads/make_turn2_workload.py --sessions
      hf-adaspec bench --prompts benchmarks/workloads/spec_bench_sessions.jsonl --per-category 2 --split held-out
Then: hf-adaspec trace --prompts benchmarks/workloads/spec_bench_turn2.jsonl --per-category 2 \
      --max-new-tokens 256 --output benchmarks/traces --workload spec_bench_turn2
Last stdout line: one JSON object.
"""

import argparse
import json
from collections import Counter
from pathlib import Path

from transformers import AutoTokenizer

from hf_adaspec.files import atomic_write
from hf_adaspec.models.loading import resolve
from hf_adaspec.replay.trace import load_traces

ROOT = Path(__file__).resolve().parent.parent.parent
OUTPUT = Path(__file__).resolve().parent / "spec_bench_turn2.jsonl"
SESSIONS = Path(__file__).resolve().parent / "spec_bench_sessions.jsonl"
ID_OFFSET = 20000


def build(questions: Path, traces: Path) -> list[dict]:
    rows = {int(r["question_id"]): r for r in map(json.loads, questions.read_text().splitlines())}
    firsts = [t for t in load_traces(traces) if t.source == "spec_bench" and len(rows[t.question_id]["turns"]) > 1]
    tokenizer = AutoTokenizer.from_pretrained(resolve(firsts[0].target))
    out = []
    for t in sorted(firsts, key=lambda t: (t.category, t.question_id)):
        row = rows[t.question_id]
        answer = tokenizer.decode(t.tokens[t.prompt_len :], skip_special_tokens=True).strip()
        out.append(
            {
                "question_id": t.question_id + ID_OFFSET,
                "category": t.category,
                "history": [row["turns"][0], answer],
                "turns": [row["turns"][1]],
                "source": f"Spec-Bench question {t.question_id}, second turn; answer: {t.target} greedy",
            }
        )
    return out


def sessions(rows: list[dict]) -> list[dict]:
    """Each second-turn row after its first turn: [turn 1 of q, turn 2 of q, ...]."""
    out = []
    for r in rows:
        q = r["question_id"] - ID_OFFSET
        out += [
            {
                "question_id": q,
                "category": r["category"],
                "turns": [r["history"][0]],
                "source": f"Spec-Bench question {q}, first turn",
            },
            r,
        ]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--questions", type=Path, default=ROOT.parent / "shared" / "data" / "spec_bench" / "question.jsonl")
    ap.add_argument("--traces", type=Path, default=ROOT / "benchmarks" / "traces")
    ap.add_argument(
        "--output", type=Path, default=None, help=f"default: {OUTPUT.name} ({SESSIONS.name} with --sessions)"
    )
    ap.add_argument("--sessions", action="store_true", help="each second turn after its first turn")
    args = ap.parse_args()
    rows = build(args.questions, args.traces)
    rows = sessions(rows) if args.sessions else rows
    args.output = args.output or (SESSIONS if args.sessions else OUTPUT)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    atomic_write(args.output, lambda f: f.write(text.encode("utf-8")))
    print(
        json.dumps(
            {"output": str(args.output), "prompts": len(rows), "categories": dict(Counter(r["category"] for r in rows))}
        )
    )


if __name__ == "__main__":
    main()
