"""Traces: what a greedy request's outcome is fixed by, so that any policy can be replayed on it.

Under greedy decoding a policy's outcome is fixed by the prompt: the target's greedy continuation, the
draft's argmax and its probability q(x) at every position along it (one teacher-forced draft forward;
a proposal from position i is accepted exactly as far as those argmaxes agree with the target's tokens),
and what prompt lookup proposes (deterministic, recomputed from the tokens). A ``Trace`` holds these for
one prompt, plus the target's prefill time, the times at which transformers' plain ``generate`` emitted each
token (what a bench's plain run takes on the trace's machine), and the models' identities; ``replay`` prices any
schedule on it with a cost profile. One JSON file per prompt (``<question_id>.json``), written atomically, so a long
run of ``hf-adaspec trace`` resumes where it stopped.

An EAGLE-3 draft head (``models.eagle3``) drafts from the target's features, and from its second token on
from its own outputs (EAGLE-3's training-time test), so its j-th token is not a function of the tokens
alone. ``head_along`` records, from every position of the output, the chain the head drafts there: depth 1
reads the target's features of the traced positions (teacher-forced), depth d the head's own output and
its own token at depth d − 1, as it drafts (so the tokens after a miss, which the confidence stop rule and
the calibration read, are the real ones too); argmax over the target's full vocabulary and its q(x).
Traces without a head (``head`` "") are the same schema and load as before.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers.generation import BaseStreamer

from ..backend import hf_compat
from ..bench.prompts import Prompt, split_of
from ..files import atomic_write
from ..models.eagle3 import Eagle3Head, HeadCache

SCHEMA = 1
HEAD_DEPTH = 8  # tokens of the head's chain recorded per position (replay's largest k)


@dataclass(frozen=True)
class Trace:
    """One prompt's greedy outcome. tokens: prompt + plain greedy output (ids); draft_next[j], draft_q[j]:
    the draft's argmax after tokens[: prompt_len + j] and its probability, j = 0..n (n = new tokens);
    eos: the target's EOS ids; prefill_ms: the target's forward over the prompt (median, ms); plain_ms[j]: ms from
    the start of the plain greedy ``generate`` that made the output to its emitting new token j (its prefill
    included; empty: not timed, as in traces taken before it was recorded).
    head (its name, "" without one), head_next[j][d], head_q[j][d]: the head's argmax and q(x) for token
    prompt_len + j + d in the chain it drafts after tokens[: prompt_len + j] (``head_along``), j = 0..n,
    d = 0..depth − 1.

    Raises:
        ValueError: no prompt or no new token, draft or head answers not n + 1 long, plain times neither empty
            nor n long, or head rows of unequal or zero depth.
    """

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
    head: str = ""
    head_next: tuple[tuple[int, ...], ...] = ()
    head_q: tuple[tuple[float, ...], ...] = ()
    plain_ms: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.tokens) - self.prompt_len
        if self.prompt_len < 1 or n < 1:
            raise ValueError(f"trace {self.question_id}: needs a prompt and >= 1 new token, got {self.prompt_len}, {n}")
        if self.plain_ms and len(self.plain_ms) != n:
            raise ValueError(
                f"trace {self.question_id}: plain_ms needs {n} entries (or none), got {len(self.plain_ms)}"
            )
        if self.draft and not len(self.draft_next) == len(self.draft_q) == n + 1:
            raise ValueError(
                f"trace {self.question_id}: draft_next/draft_q need {n + 1} entries, "
                f"got {len(self.draft_next)}, {len(self.draft_q)}"
            )
        if self.head and not len(self.head_next) == len(self.head_q) == n + 1:
            raise ValueError(
                f"trace {self.question_id}: head_next/head_q need {n + 1} rows, "
                f"got {len(self.head_next)}, {len(self.head_q)}"
            )
        if self.head and len({len(r) for r in (*self.head_next, *self.head_q)} | {0}) != 2:
            raise ValueError(f"trace {self.question_id}: head_next/head_q rows need one depth >= 1")

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
    def head_depth(self) -> int:
        """Tokens of the head's chain recorded per position (0 without a head)."""
        return len(self.head_next[0]) if self.head else 0

    def head_runs(self) -> list[int]:
        """runs[j-1] for generated tokens j = 1..n-1: how many leading tokens of the head's chain drafted
        after tokens[: prompt_len + j] equal the target's (at most ``head_depth``; empty without a head)."""
        if not self.head:
            return []
        runs = []
        for j in range(1, self.new_tokens):
            truth = self.tokens[self.prompt_len + j :]
            same = [a == b for a, b in zip(self.head_next[j], truth, strict=False)]
            runs.append(same.index(False) if False in same else len(same))
        return runs

    def head_agreement(self) -> list[bool]:
        """``draft_agreement`` for the head's first token (empty without a head)."""
        return [r > 0 for r in self.head_runs()]

    @property
    def split(self) -> str:
        """ "tune" or "held-out" (``prompts.split_of``)."""
        return split_of(self.question_id)

    def truncated(self, max_new_tokens: int) -> Trace:
        """The same request asked for at most ``max_new_tokens`` (its first tokens, the draft's and the head's
        answers along them); itself when it asked for no more. Raises ValueError for fewer than 1 token."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        n = min(max_new_tokens, self.new_tokens)
        if max_new_tokens >= self.max_new_tokens:
            return self
        keep = n + 1  # answers after each of the n + 1 positions prompt_len - 1 .. prompt_len + n - 1
        return dataclasses.replace(
            self,
            tokens=self.tokens[: self.prompt_len + n],
            max_new_tokens=max_new_tokens,
            draft_next=self.draft_next[:keep] if self.draft else self.draft_next,
            draft_q=self.draft_q[:keep] if self.draft else self.draft_q,
            head_next=self.head_next[:keep],
            head_q=self.head_q[:keep],
            plain_ms=self.plain_ms[:n],
        )


def trace_path(directory: Path, question_id: int) -> Path:
    return directory / f"{question_id}.json"


def save_trace(trace: Trace, directory: Path) -> Path:
    """Write ``trace`` as ``<directory>/<question_id>.json`` atomically (``files.atomic_write``)."""
    path = trace_path(directory, trace.question_id)
    text = json.dumps(
        {
            **asdict(trace),
            "draft_q": [round(q, 5) for q in trace.draft_q],
            "head_q": [[round(q, 4) for q in row] for row in trace.head_q],
            "plain_ms": [round(ms, 2) for ms in trace.plain_ms],
        },
        separators=(",", ":"),
    )
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
        data["plain_ms"] = tuple(data.get("plain_ms", ()))
        for name in ("head_next", "head_q"):
            data[name] = tuple(tuple(row) for row in data.get(name, ()))
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
def head_along(
    target: torch.nn.Module, head: Eagle3Head, sequence: torch.Tensor, prompt_len: int, depth: int = HEAD_DEPTH
) -> tuple[list[list[int]], list[list[float]]]:
    """The head's chains along ``sequence`` [1, T] (prompt + output, n = T − prompt_len new tokens): for
    j = 0..n, the argmax over the target's vocabulary and its probability q(x) of the d-th token (d =
    1..``depth``) the head drafts after tokens[: prompt_len + j], feeding its own tokens as it drafts.
    One target forward gives the features; one head pass over them the teacher-forced entries (entry p:
    token p and the target's feature at p − 1); then ``depth`` − 1 batched head steps extend every start's
    chain with its own token and output (each start's cache holds only the entries before it). → two [n + 1][depth]
    lists. Raises ValueError for depth < 1."""
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    t = sequence.shape[1]
    sequence = sequence.to(target.device)
    features = hf_compat.forward(
        target, sequence, hf_compat.new_cache(target), 1, feature_layers=head.config.aux_layers
    )[1]  # [1, T, 3·H_t]
    whole = HeadCache(1)
    out = head.step(sequence[:, 1:], head.fuse(features[:, :-1]), torch.ones(1, t - 1, dtype=torch.bool), whole)
    starts = torch.arange(prompt_len - 1, t).clamp_min(1)  # [n+1]: the last entry before token prompt_len + j
    rows = HeadCache(len(starts))  # row j: the entries 1..starts[j]
    rows.k, rows.v = (x.expand(len(starts), -1, -1, -1) for x in (whole.k, whole.v))
    rows.mask, rows.lengths = torch.arange(t - 1)[None] < starts[:, None], starts.clone()
    hidden, nxt, q = out[0, starts - 1], [], []  # hidden [n+1, H]: each start's depth-1 output
    for d in range(depth):
        conf, arg = torch.softmax(head.logits(hidden), dim=-1).max(dim=-1)  # [n+1] each
        nxt.append(arg)
        q.append(conf)
        if d + 1 < depth:  # the next entry: the token just drafted with the head's own output, as it drafts
            hidden = head.step(
                arg[:, None].to(sequence.device), hidden[:, None], torch.ones(len(starts), 1, dtype=torch.bool), rows
            )[:, 0]
    return torch.stack(nxt, dim=1).tolist(), torch.stack(q, dim=1).tolist()


def with_head(trace: Trace, target: torch.nn.Module, head: Eagle3Head, name: str, depth: int = HEAD_DEPTH) -> Trace:
    """``trace`` with the head ``name``'s chains along its tokens (``head_along``); the rest unchanged."""
    nxt, q = head_along(target, head, torch.tensor([trace.tokens]), trace.prompt_len, depth)
    return dataclasses.replace(
        trace, head=name, head_next=tuple(tuple(r) for r in nxt), head_q=tuple(tuple(r) for r in q)
    )


@torch.no_grad()
def prefill_ms(target: torch.nn.Module, prompt: torch.Tensor, repeats: int = 2) -> float:
    """Median wall ms of the target's forward over ``prompt`` [1, T] into a fresh cache."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        hf_compat.forward_logits(target, prompt.to(target.device), hf_compat.new_cache(target), keep=1)
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


class TokenTimes(BaseStreamer):
    """A streamer for ``generate`` that notes when each new token is emitted: ``ms[j]``, ms from the streamer's
    creation to new token j (the first ``put`` is the prompt, not timed)."""

    def __init__(self) -> None:
        self.start, self.ms, self._prompt = time.perf_counter(), [], True

    def put(self, value: torch.Tensor) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.ms.append((time.perf_counter() - self.start) * 1000.0)

    def end(self) -> None:
        """Nothing to flush."""


def trace_ids(
    target,
    draft,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    ids: tuple[int, str],
    names: tuple[str, str],
    source: str = "spec_bench",
) -> Trace:
    """Plain greedy ``generate`` from input_ids [1, T], its tokens timed (``TokenTimes``), then the draft's
    teacher-forced pass along prompt + output. ids: (question_id, category); names: (target, draft) identities
    ("" draft: none)."""
    prompt_len, times = input_ids.shape[1], TokenTimes()
    out = target.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        streamer=times,
    )  # [1, T + n]
    nxt, q = draft_along(draft, out, prompt_len) if draft is not None else ([], [])
    eos = target.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or ())
    return Trace(
        ids[0],
        ids[1],
        prompt_len,
        tuple(out[0].tolist()),
        tuple(nxt),
        tuple(q),
        tuple(int(e) for e in eos),
        prefill_ms(target, input_ids),
        max_new_tokens,
        names[0],
        names[1],
        source,
        plain_ms=tuple(times.ms),
    )


def take_trace(
    target, tokenizer, draft, prompt: Prompt, max_new_tokens: int, names: tuple[str, str], source: str = "spec_bench"
) -> Trace:
    """``trace_ids`` on the chat-templated conversation of ``prompt``, as the bench runs it."""
    inputs = tokenizer.apply_chat_template(
        prompt.messages(), add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return trace_ids(
        target, draft, inputs["input_ids"], max_new_tokens, (prompt.question_id, prompt.category), names, source
    )
