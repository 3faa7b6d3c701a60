"""Traces: what a greedy request's outcome is fixed by, so that any policy can be replayed on it.

Under greedy decoding a policy's outcome is fixed by the prompt: the target's greedy continuation, the
draft's argmax and its probability q(x) at every position along it (one teacher-forced draft forward;
a proposal from position i is accepted exactly as far as those argmaxes agree with the target's tokens),
and what prompt lookup proposes (deterministic, recomputed from the tokens). A ``Trace`` holds these for
one prompt, plus the target's prefill time and the models' identities; ``replay`` prices any schedule on
it with a cost profile. One JSON file per prompt (``<question_id>.json``), written atomically, so a long
run of ``hf-adaspec trace`` resumes where it stopped.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..backend import hf_compat
from ..files import atomic_write
from .prompts import Prompt, split_of

SCHEMA = 1


@dataclass(frozen=True)
class Trace:
    """One prompt's greedy outcome. tokens: prompt + plain greedy output (ids); draft_next[j], draft_q[j]:
    the draft's argmax after tokens[: prompt_len + j] and its probability, j = 0..n (n = new tokens);
    eos: the target's EOS ids; prefill_ms: the target's forward over the prompt (median, ms)."""

    question_id: int
    category: str
    prompt_len: int
    tokens: tuple[int, ...]
    draft_next: tuple[int, ...]
    draft_q: tuple[float, ...]
    eos: tuple[int, ...]
    prefill_ms: float
    max_new_tokens: int
    target: str
    draft: str
    source: str = "spec_bench"
    schema: int = SCHEMA

    def __post_init__(self) -> None:
        n = len(self.tokens) - self.prompt_len
        if self.prompt_len < 1 or n < 1:
            raise ValueError(f"trace {self.question_id}: needs a prompt and >= 1 new token, got {self.prompt_len}, {n}")
        if self.draft and not len(self.draft_next) == len(self.draft_q) == n + 1:
            raise ValueError(f"trace {self.question_id}: draft_next/draft_q need {n + 1} entries, "
                             f"got {len(self.draft_next)}, {len(self.draft_q)}")

    @property
    def new_tokens(self) -> int:
        """Tokens the target generated (n)."""
        return len(self.tokens) - self.prompt_len

    def draft_agreement(self) -> list[bool]:
        """agree[j-1] for generated tokens j = 1..n-1 (token 0 comes from the prefill): the draft's argmax
        given the target's prefix equals the target's token (empty without a draft)."""
        if not self.draft_next:
            return []
        truth = self.tokens[self.prompt_len + 1 :]
        return [a == b for a, b in zip(self.draft_next[1 : self.new_tokens], truth, strict=True)]

    @property
    def split(self) -> str:
        """"tune" or "held-out" (``prompts.split_of``)."""
        return split_of(self.question_id)


def trace_path(directory: Path, question_id: int) -> Path:
    return directory / f"{question_id}.json"


def save_trace(trace: Trace, directory: Path) -> Path:
    """Write ``trace`` as ``<directory>/<question_id>.json`` atomically (``files.atomic_write``)."""
    path = trace_path(directory, trace.question_id)
    text = json.dumps({**asdict(trace), "draft_q": [round(q, 5) for q in trace.draft_q]}, separators=(",", ":"))
    atomic_write(path, lambda f: f.write(text.encode()))
    return path


def load_trace(path: Path) -> Trace:
    """Read one trace. Raises ValueError (naming the file and the fix) for an unreadable or foreign file."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema')} (this version reads {SCHEMA})")
        for name in ("tokens", "draft_next", "draft_q", "eos"):
            data[name] = tuple(data[name])
        return Trace(**data)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{path}: not a readable trace ({e}); delete it and re-run `hf-adaspec trace`") from e


def load_traces(directory: Path, ids: Iterable[int] | None = None) -> list[Trace]:
    """Every trace in ``directory`` (sorted by question id), or those of ``ids`` in that order.

    Raises FileNotFoundError when the directory holds none, or one of ``ids`` is missing."""
    directory = Path(directory)
    if ids is None:
        paths = sorted(directory.glob("[0-9]*.json"), key=lambda p: int(p.stem))
        if not paths:
            raise FileNotFoundError(f"no traces in {directory}; take them with `hf-adaspec trace --output {directory}`")
    else:
        paths = [trace_path(directory, i) for i in ids]
        missing = [p.name for p in paths if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"traces missing in {directory}: {missing[:5]}; take them with `hf-adaspec trace`")
    return [load_trace(p) for p in paths]


@torch.no_grad()
def draft_along(draft: torch.nn.Module, sequence: torch.Tensor, prompt_len: int) -> tuple[list[int], list[float]]:
    """The draft's argmax and its probability after each prefix sequence[:, : prompt_len + j], j = 0..n, from
    one teacher-forced forward. sequence: [1, T] long → two lists of n + 1 = T - prompt_len + 1."""
    n = sequence.shape[1] - prompt_len
    logits = hf_compat.forward_logits(draft, sequence.to(draft.device), hf_compat.new_cache(draft), keep=n + 1)
    probs = torch.softmax(logits[0].float(), dim=-1)  # [n+1, V]
    q, nxt = probs.max(dim=-1)
    return nxt.tolist(), q.tolist()


@torch.no_grad()
def prefill_ms(target: torch.nn.Module, prompt: torch.Tensor, repeats: int = 2) -> float:
    """Median wall ms of the target's forward over ``prompt`` [1, T] into a fresh cache."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        hf_compat.forward_logits(target, prompt.to(target.device), hf_compat.new_cache(target), keep=1)
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def trace_ids(target, draft, input_ids: torch.Tensor, max_new_tokens: int, ids: tuple[int, str],
              names: tuple[str, str], source: str = "spec_bench") -> Trace:
    """Plain greedy ``generate`` from input_ids [1, T], then the draft's teacher-forced pass along prompt +
    output. ids: (question_id, category); names: (target, draft) identities ("" draft: none)."""
    prompt_len = input_ids.shape[1]
    out = target.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                          max_new_tokens=max_new_tokens, do_sample=False)  # [1, T + n]
    nxt, q = draft_along(draft, out, prompt_len) if draft is not None else ([], [])
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or ())
    return Trace(ids[0], ids[1], prompt_len, tuple(out[0].tolist()), tuple(nxt), tuple(q), tuple(int(e) for e in eos),
                 prefill_ms(target, input_ids), max_new_tokens, names[0], names[1], source)


def take_trace(target, tokenizer, draft, prompt: Prompt, max_new_tokens: int, names: tuple[str, str],
               source: str = "spec_bench") -> Trace:
    """``trace_ids`` on the chat-templated conversation of ``prompt``, as the bench runs it."""
    inputs = tokenizer.apply_chat_template(prompt.messages(), add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    return trace_ids(target, draft, inputs["input_ids"], max_new_tokens, (prompt.question_id, prompt.category),
                     names, source)
