"""The draft's two most probable tokens after every prefix of each trace's greedy output (input to
``candidate_trees.py``, issue 26 item 3).

One teacher-forced forward of the default draft (Qwen2.5-Coder-0.5B NF4, as ``hf-adaspec trace`` loads it)
over prompt + output per trace, as ``trace.draft_along`` does, keeping the top two: first[j], q1[j],
second[j], q2[j] after tokens[: prompt_len + j], j = 0..n. ``first`` is checked against the trace's
``draft_next`` (the share that agrees is printed: the same model and forward should give 1.0).

Run: python benchmarks/draft_top2.py [--traces benchmarks/traces]
Writes benchmarks/results/draft_top2.json (atomically; a rerun keeps traces already done); last stdout
line: one JSON object.
"""

import argparse
import json
from pathlib import Path

import torch

import hf_adaspec
from hf_adaspec.files import atomic_write
from hf_adaspec.backend import hf_compat
from hf_adaspec.tools.trace import load_traces

OUT = Path("benchmarks/results/draft_top2.json")


@torch.no_grad()
def top2_along(draft: torch.nn.Module, sequence: torch.Tensor, prompt_len: int) -> dict[str, list]:
    """Top-2 tokens and probabilities after sequence[:, : prompt_len + j], j = 0..n. sequence: [1, T]."""
    n = sequence.shape[1] - prompt_len
    logits = hf_compat.forward_logits(draft, sequence, hf_compat.new_cache(draft), keep=n + 1)  # [1, n+1, V]
    q, tok = torch.softmax(logits[0].float(), dim=-1).topk(2, dim=-1)  # [n+1, 2]
    return {"first": tok[:, 0].tolist(), "q1": [round(x, 5) for x in q[:, 0].tolist()],
            "second": tok[:, 1].tolist(), "q2": [round(x, 5) for x in q[:, 1].tolist()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=Path("benchmarks/traces"))
    args = ap.parse_args()
    done = json.loads(OUT.read_text())["traces"] if OUT.exists() else {}
    traces = [t for t in load_traces(args.traces) if t.draft and str(t.question_id) not in done]
    if traces:
        draft = hf_adaspec.load(traces[0].draft, quantize_lm_head=True).model
        for i, t in enumerate(traces):
            done[str(t.question_id)] = top2_along(draft, torch.tensor([t.tokens]), t.prompt_len)
            if i % 8 == 7 or i == len(traces) - 1:
                text = json.dumps({"model": traces[0].draft, "traces": done}, separators=(",", ":"))
                atomic_write(OUT, lambda f, text=text: f.write(text.encode()))
                print(f"{len(done)} traces", flush=True)
    agree = total = 0
    for t in load_traces(args.traces):
        row = done.get(str(t.question_id))
        if row:
            agree += sum(a == b for a, b in zip(row["first"], t.draft_next, strict=True))
            total += len(t.draft_next)
    print(json.dumps({"traces": len(done), "first_equals_draft_next": round(agree / max(total, 1), 4)}))


if __name__ == "__main__":
    main()
