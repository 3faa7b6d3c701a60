"""Does the draft model need the whole prompt? Greedy agreement with the target and the catch-up cost
when the draft sees only the prompt's first ``--sink`` tokens and its last W.

For each of the bench's prompts in ``--categories``: the target's plain greedy answer (NF4, the default
pair); then for each window W the draft reads [first sink tokens, last W prompt tokens, answer] in one
teacher-forced forward, and agreement is the share of answer tokens whose draft argmax equals the
target's token (greedy per-token α). The catch-up is the median time of the draft's forward over the
windowed prompt alone (ms, 3 repeats).

Run: python benchmarks/draft_window.py --categories extraction,summarization,rag,translation
Last stdout line: one JSON object (per category and window: agreement and catch-up ms).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import chat_inputs, load_pair, prompt_options

from hf_adaspec.backend import hf_compat
from hf_adaspec.tools.bench import load_prompts


def windowed(prompt: torch.Tensor, sink: int, window: int | None) -> torch.Tensor:
    """prompt [1, T] → its first ``sink`` and last ``window`` tokens, [1, ≤ T] (all of it if None or short)."""
    if window is None or prompt.shape[1] <= sink + window:
        return prompt
    return torch.cat([prompt[:, :sink], prompt[:, -window:]], dim=1)


@torch.no_grad()
def agreement(draft, context: torch.Tensor, answer: torch.Tensor) -> float:
    """Share of answer tokens ([1, n]) the draft's argmax predicts after ``context`` ([1, T])."""
    x = torch.cat([context, answer], dim=1)
    logits = hf_compat.forward_logits(draft, x, hf_compat.new_cache(draft), keep=answer.shape[1] + 1)
    return float((logits[0, :-1].argmax(-1) == answer[0]).float().mean())


@torch.no_grad()
def catchup_ms(draft, context: torch.Tensor, repeats: int = 3) -> float:
    """Median ms of one draft forward over ``context`` into an empty cache."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        hf_compat.forward_logits(draft, context, hf_compat.new_cache(draft), keep=1)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    prompt_options(ap)
    ap.add_argument("--categories", default="extraction,summarization,rag,translation")
    ap.add_argument("--windows", default="full,512,256,128,64")
    ap.add_argument("--sink", type=int, default=32)
    args = ap.parse_args()
    windows = [None if w == "full" else int(w) for w in args.windows.split(",")]
    model, tokenizer, draft = load_pair()
    prompts = load_prompts(Path(args.questions), args.per_category, args.categories.split(","))
    rows = []
    for p in prompts:
        inputs = chat_inputs(tokenizer, p.text)
        prompt = inputs["input_ids"]
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
        answer = out[:, prompt.shape[1]:]
        for w in windows:
            ctx = windowed(prompt, args.sink, w)
            rows.append({"category": p.category, "question_id": p.question_id, "window": w or "full",
                         "prompt_tokens": prompt.shape[1], "answer_tokens": answer.shape[1],
                         "agreement": agreement(draft, ctx, answer), "catchup_ms": catchup_ms(draft, ctx)})
            r = rows[-1]
            print(f"{p.category:14s} {p.question_id:4d} T={r['prompt_tokens']:4d} n={r['answer_tokens']:3d} "
                  f"W={str(r['window']):>4s} agree {r['agreement']:.3f} catch-up {r['catchup_ms']:.0f} ms")
    summary: dict = {}
    for r in rows:
        cell = summary.setdefault(r["category"], {}).setdefault(str(r["window"]), {"agreement": [], "catchup_ms": []})
        cell["agreement"].append(r["agreement"])
        cell["catchup_ms"].append(r["catchup_ms"])
    for cat in summary.values():
        for w, cell in cat.items():
            cat[w] = {k: round(statistics.mean(v), 3) for k, v in cell.items()}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
