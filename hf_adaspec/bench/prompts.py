"""Benchmark prompts: the ``Prompt`` type, Spec-Bench style JSONL workloads (the packaged default subset or
any file), and the tune / held-out split policies are decided and reported on."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: Spec-Bench id, category, the user turn to answer and the conversation before
    it (``history``: alternating user and assistant turns; empty for a first turn)."""

    question_id: int
    category: str
    text: str
    history: tuple[str, ...] = ()

    def messages(self) -> list[dict[str, str]]:
        """The chat to template: the history's turns (user first), then ``text`` as the user's."""
        roles = ("user", "assistant")
        return [{"role": roles[i % 2], "content": t} for i, t in enumerate((*self.history, self.text))]


SPLITS = ("all", "tune", "held-out")


def split_of(question_id: int) -> str:
    """ "tune" (even question id) or "held-out" (odd): Spec-Bench's ids run consecutively within a category,
    so every category has prompts in both halves. Policies are tuned on one and reported on the other."""
    return "tune" if question_id % 2 == 0 else "held-out"


def packaged_prompts() -> Path:
    """The Spec-Bench subset shipped inside the package (``hf_adaspec/data/spec_bench.jsonl``: the first
    ``PACKAGED_PER_CATEGORY`` prompts of each category, Apache-2.0), found from the installed package."""
    import importlib.resources

    return Path(str(importlib.resources.files("hf_adaspec").joinpath("data", "spec_bench.jsonl")))


# the default workload of ``bench`` and ``trace``; the full Spec-Bench file (480 prompts) is not shipped
SPEC_BENCH = packaged_prompts()
PACKAGED_PER_CATEGORY = 8


def load_prompts(
    path: Path, per_category: int, categories: list[str] | None = None, split: str = "all"
) -> list[Prompt]:
    """First ``per_category`` prompts of each category from a Spec-Bench style JSONL (the first of a row's
    ``turns``, after its ``history`` if the row has one), from the ``split`` ("all", or one half: ``split_of``).
    ``SPEC_BENCH`` (the packaged subset) has ``PACKAGED_PER_CATEGORY`` prompts per category.

    Raises:
        FileNotFoundError: no such file, naming the fix (``--prompts``; the packaged default).
        ValueError: an unknown split.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose from {SPLITS}")
    path = Path(path)
    if not path.is_file():
        fix = (
            "this install of hf-adaspec lacks its packaged prompts: reinstall it"
            if path == SPEC_BENCH
            else f"leave --prompts out for the packaged Spec-Bench subset ({SPEC_BENCH})"
        )
        raise FileNotFoundError(
            f"prompts file not found: {path}; pass --prompts PATH to a Spec-Bench style "
            f"JSONL (fields question_id, category, turns), or {fix}"
        )
    taken: dict[str, list[Prompt]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        cat = row["category"]
        if categories and cat not in categories or split not in ("all", split_of(int(row["question_id"]))):
            continue
        bucket = taken.setdefault(cat, [])
        if len(bucket) < per_category:
            bucket.append(Prompt(int(row["question_id"]), cat, row["turns"][0], tuple(row.get("history", ()))))
    return [p for bucket in taken.values() for p in bucket]
