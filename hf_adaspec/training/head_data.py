"""Self-distillation data for a draft head: the target's features and its own next-token distribution along
text, recorded once to disk in shards so training and its data-scaling curve reread them.

Design: a head is trained to agree with its target, so the labels are the target's, not the text's: one
teacher-forced target forward over a sequence gives, at every position, its features g [T, 3·H_t] (the
residual stream at the inputs of the head's three feature layers) and its top-k next-token
log-probabilities. Training text is code from installed third-party packages (their own source, under
their own licences, recorded per file), cut into sequences of ``seq_len`` tokens; evaluation is along
committed greedy traces (the target's own outputs on held-out prompts), scored at output positions only.
Shards are written atomically and named by index, so a killed recording resumes at the first missing
shard and re-recording writes identical files (fixed file order and chunking).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from tqdm.auto import tqdm

from ..backend import hf_compat
from ..bench.prompts import split_of
from ..files import atomic_write
from ..replay.trace import Trace

TOP_K = 8
EXCLUDED_PARTS = ("_vendor", "vendored", "third_party", "tests", "test")  # copies of other projects, and tests


@dataclass(frozen=True)
class Sequences:
    """A batch of sequences for the head: tokens [N, T] long, features [N, T, 3·H_t] bf16, the target's
    top-k next-token ids [N, T, K] long and log-probabilities [N, T, K] float, scored [N, T] bool (the
    positions whose next token counts: every one of training text, the outputs of a trace)."""

    tokens: torch.Tensor
    features: torch.Tensor
    top_ids: torch.Tensor
    top_logp: torch.Tensor
    scored: torch.Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def rows(self, index: torch.Tensor) -> Sequences:
        """The sequences ``index`` ([b] long)."""
        return Sequences(*(t[index] for t in (self.tokens, self.features, self.top_ids, self.top_logp, self.scored)))

    def save(self, path: Path) -> None:
        """Write atomically (safetensors)."""
        tensors = {
            "tokens": self.tokens,
            "features": self.features,
            "top_ids": self.top_ids.int(),
            "top_logp": self.top_logp.half(),
            "scored": self.scored,
        }
        atomic_write(path, lambda f: f.write(_serialize(tensors)))

    @classmethod
    def load(cls, path: Path) -> Sequences:
        t = load_file(str(path))
        return cls(t["tokens"].long(), t["features"], t["top_ids"].long(), t["top_logp"].float(), t["scored"])


def _serialize(tensors: dict[str, torch.Tensor]) -> bytes:
    return save({k: v.contiguous() for k, v in tensors.items()})


def source_files(roots: list[Path], seed: int = 0) -> list[Path]:
    """The ``*.py`` files under ``roots`` (no vendored copies, no tests), in a fixed shuffled order.
    Raises FileNotFoundError when there are none."""
    files = sorted(
        p
        for root in roots
        for p in Path(root).rglob("*.py")
        if not set(p.relative_to(root).parts[:-1]) & set(EXCLUDED_PARTS)
    )
    if not files:
        raise FileNotFoundError(f"no Python files under {[str(r) for r in roots]}")
    random.Random(seed).shuffle(files)
    return files


def chunks(tokenizer, files: list[Path], seq_len: int) -> Iterator[list[int]]:
    """The files' text tokenised and concatenated (an EOS between files), cut into ``seq_len``-token lists."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    buffer: list[int] = []
    for path in files:
        buffer += tokenizer(path.read_text(errors="replace"))["input_ids"] + [eos]
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            buffer = buffer[seq_len:]


@torch.no_grad()
def label(
    target: torch.nn.Module, tokens: torch.Tensor, aux_layers: tuple[int, ...], scored: torch.Tensor
) -> Sequences:
    """One target forward over tokens [N, T]: its features at ``aux_layers`` and top-k next-token
    log-probabilities at every position."""
    logits, features = hf_compat.forward(
        target, tokens, hf_compat.new_cache(target), tokens.shape[1], feature_layers=aux_layers
    )  # [N, T, V], [N, T, 3·H_t]
    top, ids = torch.log_softmax(logits.cpu(), dim=-1).topk(TOP_K, dim=-1)  # [N, T, K]
    return Sequences(tokens, features.to(torch.bfloat16), ids, top, scored)


def record(
    target,
    tokenizer,
    roots: list[Path],
    out: Path,
    tokens: int,
    aux_layers: tuple[int, ...],
    seq_len: int = 512,
    shard_seqs: int = 16,
    batch: int = 4,
) -> list[Path]:
    """Shards ``out/shard-00000.safetensors``... of ``shard_seqs`` sequences each, until ``tokens`` tokens are
    recorded; existing shards are kept (resume). Writes ``out/sources.json``: the stream's file order (the
    recorded text is a prefix of it).
    → the shard paths."""
    files = source_files(roots)
    per_shard = seq_len * shard_seqs
    count = -(-tokens // per_shard)
    paths = [out / f"shard-{i:05d}.safetensors" for i in range(count)]
    stream = chunks(tokenizer, files, seq_len)
    bar = tqdm(total=count * per_shard, unit="tok", desc="recording features", smoothing=0.05)
    for path in paths:
        seqs = [next(stream) for _ in range(shard_seqs)]
        if not path.exists():
            parts = [
                label(
                    target,
                    torch.tensor(seqs[i : i + batch]),
                    aux_layers,
                    torch.ones(len(seqs[i : i + batch]), seq_len, dtype=torch.bool),
                )
                for i in range(0, shard_seqs, batch)
            ]
            Sequences(*(torch.cat(x) for x in zip(*(_fields(p) for p in parts), strict=True))).save(path)
        bar.update(per_shard)
    bar.close()
    read = [str(f) for f in files]
    atomic_write(
        out / "sources.json",
        lambda f: f.write(json.dumps({"roots": [str(r) for r in roots], "files_in_order": read}).encode()),
    )
    return paths


def _fields(s: Sequences) -> tuple[torch.Tensor, ...]:
    return s.tokens, s.features, s.top_ids, s.top_logp, s.scored


def record_traces(target, traces: list[Trace], path: Path, aux_layers: tuple[int, ...]) -> Sequences:
    """The validation set along ``traces`` (each prompt + the target's greedy output, right-padded to the
    longest), scored at the positions whose next token is an output; cached at ``path``."""
    if path.exists():
        return Sequences.load(path)
    width = max(len(t.tokens) for t in traces)
    parts = []
    for t in tqdm(traces, desc=f"recording {path.stem}"):
        tokens = torch.tensor([t.tokens])
        scored = torch.zeros(1, len(t.tokens), dtype=torch.bool)
        scored[0, t.prompt_len - 1 : -1] = True
        parts.append(_pad(label(target, tokens, aux_layers, scored), width))
    out = Sequences(*(torch.cat(x) for x in zip(*(_fields(p) for p in parts), strict=True)))
    out.save(path)
    return out


def _pad(s: Sequences, width: int) -> Sequences:
    extra = width - s.tokens.shape[1]
    return Sequences(*(torch.nn.functional.pad(t, [0, 0] * (t.dim() - 2) + [0, extra]) for t in _fields(s)))


def held_out(traces: list[Trace], source: str) -> list[Trace]:
    """The traces of ``source`` whose prompts are in the held-out split (never tuned on)."""
    return [t for t in traces if t.source == source and split_of(t.question_id) == "held-out"]


def read_shards(paths: list[Path]) -> Sequences:
    """The shards ``paths`` as one set (in memory)."""
    return Sequences(*(torch.cat(x) for x in zip(*(_fields(Sequences.load(p)) for p in paths), strict=True)))
