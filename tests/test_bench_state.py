"""No benchmark times a prompt whose answer its learned state already holds (issue 37): suffix drafting would
recall the answer, so a repeat (``--repeats``) or a larger batch size (``--batch-size 1,2``) would be timed on
its own answer. A spy on ``record_run`` sees, for every finished request, the state it ran on before that state
learns the request: its suffix memory must not hold the request's answer. Tiny models, no downloads."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest
from conftest import build_tiny_tokenizer
from typer.testing import CliRunner

from hf_adaspec import LoadedModel
from hf_adaspec.cli import cli

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")
TEXTS = {
    "coding": ["w3 w9 w17 w3 w9 w21 w5", "w40 w41 w7 w40 w41 w33"],
    "qa": ["w12 w28 w12 w28 w60 w2 w19", "w50 w8 w14 w50 w8 w44 w31 w6"],
}


@pytest.fixture
def bench_setup(tmp_path, monkeypatch, models):
    """A prompts file of 4 prompts (2 categories), the tiny pair behind the CLI's loader, and the spy: returns
    (prompts path, seen) where seen gets (prompt, answer, answers the state held) per finished request."""
    rows = [
        {"question_id": 2 * i + j, "category": cat, "turns": [text]}
        for i, (cat, texts) in enumerate(TEXTS.items())
        for j, text in enumerate(texts)
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    pair = (LoadedModel(models["target"], tokenizer, "t"), LoadedModel(models["noisy_copy"], tokenizer, "d"))
    monkeypatch.setattr(cli, "_load_pair", lambda *args: pair)
    engine_run = importlib.import_module("hf_adaspec.engine.run")  # where generate's requests are recorded
    seen = []
    original = engine_run.record_run

    def spy(state, run, prompts, outputs):
        held = {tuple(np.asarray(s).tolist()) for s in state.suffixes.sequences}
        seen.extend((tuple(p), tuple(o), held) for p, o in zip(prompts, outputs, strict=True))
        return original(state, run, prompts, outputs)

    monkeypatch.setattr(engine_run, "record_run", spy)
    return path, seen


def _check_timed(seen: list) -> list:
    """The requests on the file's prompts (warm-ups are all unknown words, id 0): none ran on a state that
    held its own answer; different prompts gave different answers (so a held answer can only be its own)."""
    timed = [(p, o, held) for p, o, held in seen if any(p)]
    answers: dict[tuple, set] = {}
    for prompt, answer, _ in timed:
        answers.setdefault(prompt, set()).add(answer)
    assert len(answers) == 4 and all(len(a) == 1 for a in answers.values())  # greedy: one answer per prompt
    assert len({next(iter(a)) for a in answers.values()}) == 4
    assert not [(p, o) for p, o, held in timed if o in held], "a timed run started with its answer in memory"
    assert any(held for _, _, held in timed)  # the states still learn across prompts
    return timed


def test_repeats_start_from_the_state_before_the_prompt(bench_setup, tmp_path):
    path, seen = bench_setup
    result = CliRunner().invoke(
        cli.app,
        [
            "bench",
            "--prompts",
            str(path),
            "--per-category",
            "2",
            "--repeats",
            "2",
            "--max-new-tokens",
            "8",
            "--methods",
            "plain,adaptive,adaptive-lookup",
            "--output",
            str(tmp_path / "out" / "bench.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    timed = _check_timed(seen)
    assert len(timed) == 4 * 2 * 2  # prompts × speculative methods × repeats


@pytest.mark.slow  # the fast suite keeps the repeats' case of the same rule
def test_each_batch_size_starts_from_a_fresh_state(bench_setup, tmp_path):
    path, seen = bench_setup
    result = CliRunner().invoke(
        cli.app,
        [
            "bench",
            "--prompts",
            str(path),
            "--batch-size",
            "1,2",
            "--batch-prompts",
            "4",
            "--max-new-tokens",
            "8",
            "--batch-methods",
            "plain,fixed-k,adaptive",
            "--output",
            str(tmp_path / "out" / "batch.json"),
        ],
    )
    assert result.exit_code == 0, result.output
    timed = _check_timed(seen)
    assert len(timed) == 2 * (4 + 4)  # speculative methods × (4 rows at B = 1 + 4 rows at B = 2)


def test_the_state_after_the_first_repeat_is_kept_for_the_next_prompts(models):
    from hf_adaspec.bench.bench import run_prompt
    from hf_adaspec.bench.prompts import Prompt

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    cfg = {"fixed_k": 3, "max_new_tokens": 6, "repeats": 3, "states": {}}
    for i, text in enumerate(TEXTS["coding"]):
        run_prompt(models["target"], tokenizer, None, Prompt(i, "coding", text), ["plain", "adaptive-lookup"], i, cfg)
    memory = cfg["states"]["adaptive-lookup"].suffixes.sequences
    assert len(memory) == 2  # one answer per prompt: the first repeat's, not one per repeat
