"""A tokenizer's vocabulary ranked by frequency in text: which tokens a ranked draft head keeps (``ranked_head``).

Design: FR-Spec (Zhao et al., arXiv 2502.14856) restricts the draft's head to the most frequent tokens of a corpus.
The ranking is counted from text that no benchmark is built from (``benchmarks/ranked_vocab.py rank``: installed
third-party packages' source and their descriptions, not Spec-Bench and not CPython's standard library, which the
code workload comes from), with the tokenizer's special tokens (its EOS among them) ranked first, so a draft can
always end a proposal. It belongs to one tokenizer: keyed by ``tokenizer_key`` (a digest of its token → id map).
A ranking is a small JSON document (``files.write_json_verified``: written atomically, its digest checked at every
read): the key, a line on its source, the tokens counted, and the ranked ids (most frequent first; only tokens
seen, at most ``MAX_KEPT``) as base64 of little-endian int32. It is looked up as package data
(``hf_adaspec/data/vocab_rank-<key>.json``), then in the cache (``<cache>/vocab_rank/<key>.json``).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from ..files import read_json_verified, write_json_verified
from .assets import cache_dir

SCHEMA = 1
MAX_KEPT = 65536  # ids stored per ranking: the largest |S| a ranked head can take from it
MAKE = "python benchmarks/ranked_vocab.py rank --model <the draft>"  # the command that makes a ranking


def tokenizer_key(tokenizer) -> str:
    """16 hex digits of the SHA-256 of the tokenizer's token → id map (added tokens included)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def count_tokens(tokenizer, texts: Iterable[str], vocab: int) -> tuple[torch.Tensor, int]:
    """How often each id occurs in ``texts`` tokenized (no special tokens added): counts [vocab] long and the
    tokens counted."""
    counts = np.zeros(vocab, dtype=np.int64)
    total = 0
    for text in texts:
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        ids = ids[ids < vocab]
        counts += np.bincount(ids, minlength=vocab)
        total += int(ids.size)
    return torch.from_numpy(counts), total


def rank(counts: torch.Tensor, first: Iterable[int] = ()) -> torch.Tensor:
    """Ids [≤ MAX_KEPT] long: ``first`` (e.g. special tokens) in their order, then every id with a nonzero count
    (counts [V], integer or float weights), most frequent first (ties: lower id first)."""
    first = list(dict.fromkeys(int(i) for i in first))
    order = sorted((i for i in torch.nonzero(counts).flatten().tolist()), key=lambda i: (-float(counts[i]), i))
    taken = set(first)
    return torch.tensor((first + [i for i in order if i not in taken])[:MAX_KEPT], dtype=torch.long)


def special_ids(tokenizer) -> list[int]:
    """The tokenizer's special and added tokens' ids (EOS first where it has one)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += list(tokenizer.all_special_ids) + sorted(tokenizer.get_added_vocab().values())
    return list(dict.fromkeys(ids))


def save_ranking(path: Path, tokenizer, ids: torch.Tensor, source: str, counted: int) -> None:
    """Write the ranking ``ids`` (most frequent first) of ``tokenizer`` to ``path`` (atomically, with a digest)."""
    data = np.asarray(ids, dtype="<i4").tobytes()
    document = {"schema": SCHEMA, "tokenizer": tokenizer_key(tokenizer), "source": source, "counted_tokens": counted}
    write_json_verified(path, {**document, "size": int(len(ids)), "ids": base64.b64encode(data).decode()})


def read_ranking(path: Path, tokenizer) -> torch.Tensor:
    """The ranked ids [N] long at ``path``, checked: its digest, its schema, that it belongs to ``tokenizer`` and
    holds distinct ids within its vocabulary.

    Raises:
        FileNotFoundError: no file at ``path``.
        ValueError: corrupted or edited (digest), another schema, another tokenizer's, or bad ids; the message
            names ``path`` and the command that makes it again.
    """
    try:
        doc = read_json_verified(path)
        if doc.get("schema") != SCHEMA:
            raise ValueError(f"schema {doc.get('schema')!r}, expected {SCHEMA}")
        if doc["tokenizer"] != tokenizer_key(tokenizer):
            raise ValueError(f"it ranks another tokenizer's vocabulary ({doc['tokenizer']})")
        ids = torch.from_numpy(np.frombuffer(base64.b64decode(doc["ids"]), dtype="<i4").astype(np.int64))
        if ids.numel() != doc["size"] or ids.unique().numel() != ids.numel() or ids.min() < 0:
            raise ValueError("its ids are not the distinct ids it records")
        if ids.max() >= len(tokenizer):
            raise ValueError(f"id {int(ids.max())} lies outside the tokenizer's {len(tokenizer)} tokens")
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"the vocabulary ranking {path} is not usable ({e}); make it again: {MAKE}") from None
    return ids


def package_path(tokenizer) -> Path:
    """Where a ranking shipped with the package for ``tokenizer`` lies."""
    return Path(__file__).parent.parent / "data" / f"vocab_rank-{tokenizer_key(tokenizer)}.json"


def cache_path(tokenizer) -> Path:
    """Where a ranking made on this machine for ``tokenizer`` lies (``<cache>/vocab_rank/<key>.json``)."""
    return cache_dir() / "vocab_rank" / f"{tokenizer_key(tokenizer)}.json"


def ranking(tokenizer, size: int | None = None) -> torch.Tensor:
    """``tokenizer``'s ranked ids [size] long (most frequent first; all of them for None): the package's ranking
    for it, else the cache's (``read_ranking``).

    Raises:
        FileNotFoundError: no ranking for this tokenizer (names the command that makes one).
        ValueError: as ``read_ranking``; a ``size`` below 1 or beyond the ranking's ids.
    """
    path = next((p for p in (package_path(tokenizer), cache_path(tokenizer)) if p.exists()), None)
    if path is None:
        raise FileNotFoundError(
            f"no vocabulary ranking for this tokenizer ({tokenizer_key(tokenizer)}) in {package_path(tokenizer)} "
            f"or {cache_path(tokenizer)}; make one: {MAKE} --output {cache_path(tokenizer)}"
        )
    ids = read_ranking(path, tokenizer)
    if size is not None and not 1 <= size <= ids.numel():
        raise ValueError(f"a ranked vocabulary of {size} tokens: {path} ranks 1 to {ids.numel()} tokens")
    return ids if size is None else ids[:size]
