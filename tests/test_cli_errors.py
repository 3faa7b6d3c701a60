"""Bad input to the command line (issue 37): every row is a usage error — exit code 2, one ``Error:`` line that
names the fix, no traceback — raised before any model is loaded or any output written. Each command runs from
an empty working directory (outside the repository), with the model loaders replaced: no model is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hf_adaspec.cli import cli, trace_cli
from hf_adaspec.costs.predictors import ProfileCell
from hf_adaspec.costs.profile import assemble_profile
from hf_adaspec.costs.profile_files import save_profile
from hf_adaspec.replay.trace import Trace, save_trace

META = {"versions": {}, "machine": "", "cpu": "", "threads": 1, "created": "", "command": "", "grid": {}}


@pytest.fixture
def files(tmp_path, monkeypatch):
    """An empty working directory; model loaders that fail the test if called; and, under tmp_path: a
    profile, a folder with one trace, malformed files, a folder and a plain file."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HF_ADASPEC_CACHE", str(tmp_path / "cache"))

    def no_models(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(cli, "_load_pair", no_models)
    monkeypatch.setattr(trace_cli, "load_pair", no_models)
    cells = {"target": [ProfileCell(1, c, n, 20.0 + n + c / 100) for c in (16, 64) for n in (1, 2, 4)]}
    save_profile(assemble_profile("tiny", {"target": {"name": "t"}}, cells, META), tmp_path / "profile.json")
    save_trace(Trace(1, "test", 3, (1, 2, 3, 4, 5), (4, 5, 0), (0.5,) * 3, (), 10.0, 2, "t", ""), tmp_path / "traces")
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "bad.jsonl").write_text('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n{not json\n')
    (tmp_path / "fields.jsonl").write_text('{"question_id": 1, "turns": ["hi"]}\n')
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    return tmp_path


# (arguments, with {t} for tmp_path; what the one error line must say: the flag and the fix)
ROWS = [
    # bench
    ("bench --prompts /nonexistent.jsonl", ["--prompts", "/nonexistent.jsonl", "leave --prompts out"]),
    ("bench --prompts /nonexistent.jsonl --batch-size 1,2", ["--prompts", "leave --prompts out"]),
    ("bench --prompts {t}/folder", ["--prompts", "is a folder", "JSONL file"]),
    ("bench --prompts {t}/bad.jsonl", ["--prompts", "line 2", "fix that line"]),
    ("bench --prompts {t}/fields.jsonl --batch-size 2", ["--prompts", "line 1", "category"]),
    ("bench --methods plain,fast", ["--methods", "choose from", "adaptive-lookup"]),
    ("bench --methods adaptive", ["--methods", "including plain"]),
    ("bench --draft none", ["--draft none", "name one with --draft", "--methods plain,plain-again"]),
    ("bench --batch-size 1 --draft none", ["--draft none", "name one with --draft", "--batch-methods plain"]),
    ("bench --batch-size 1 --batch-methods plain,fast", ["--batch-methods", "choose from"]),
    ("bench --batch-size 0", ["--batch-size", ">= 1"]),
    ("bench --batch-size 1,two", ["--batch-size", "comma-separated integers"]),
    ("bench --categories nosuch", ["--categories", "its categories", "coding"]),
    ("bench --split half", ["--split", "all, tune, held-out"]),
    ("bench --fixed-k 0", ["--fixed-k"]),
    ("bench --fixed-k 65", ["--fixed-k"]),
    ("bench --repeats 0", ["--repeats"]),
    ("bench --output {t}/folder", ["--output", "is a folder", "give a file path"]),
    ("bench --batch-size 2 --output {t}/folder", ["--output", "is a folder"]),
    # generate
    ("generate --speculation fixed --k -3", ["--k", "0"]),
    ("generate --speculation fixed --k 65", ["--k", "64"]),
    ("generate --speculation fast", ["--speculation", "adaptive, fixed or off"]),
    ("generate --do-sample --temperature 0", ["temperature > 0", "leave --do-sample out"]),
    ("generate --do-sample --top-p 1.5", ["top-p <= 1"]),
    ("generate --max-new-tokens 0", ["--max-new-tokens"]),
    # profile
    ("profile --device tpu", ["--device", "cpu, cuda or cuda:N"]),
    ("profile --device 0", ["--device", "cpu, cuda or cuda:N"]),
    ("profile --output {t}/folder", ["--output", "is a folder"]),
    ("profile --contexts 128,x", ["--contexts", "comma-separated integers"]),
    ("profile --repeats 0", ["--repeats"]),
    ("profile --random-weights --target nosuch --output {t}/p.json", ["config.json", "give a preset"]),
    # playground
    ("playground --pair big", ["--pair", "qwen, smollm2"]),
    ("playground --port 0", ["--port"]),
    # trace
    ("trace --prompts /nonexistent.jsonl --output {t}/tr", ["--prompts", "leave --prompts out"]),
    ("trace --prompts {t}/bad.jsonl --output {t}/tr", ["--prompts", "line 2"]),
    ("trace --output {t}/file", ["--output", "is a file", "give a folder"]),
    ("trace --per-category 0", ["--per-category"]),
    # replay
    ("replay --profile /nonexistent.json", ["--profile", "hf-adaspec profile --output /nonexistent.json"]),
    ("replay --profile {t}/bad.json", ["--profile", "re-run `hf-adaspec profile`"]),
    ("replay --profile {t}/profile.json", ["--traces", "hf-adaspec trace --output benchmarks/traces"]),
    ("replay --profile {t}/profile.json --traces {t}/empty", ["--traces", "hf-adaspec trace --output"]),
    ("replay --profile {t}/profile.json --traces {t}/traces --methods plain,fast", ["--methods", "choose from"]),
    ("replay --profile {t}/profile.json --traces {t}/traces --split half", ["--split", "all, tune, held-out"]),
    ("replay --profile {t}/profile.json --traces {t}/traces --workload nosuch", ["workloads there: spec_bench"]),
    (
        "replay --profile {t}/profile.json --traces {t}/traces --bench /nonexistent.json",
        ["--bench", "hf-adaspec bench --output"],
    ),
    ("replay --profile {t}/profile.json --traces {t}/traces --bench {t}/bad.json", ["--bench", "not a bench result"]),
    (
        "replay --profile {t}/profile.json --traces {t}/traces --controller-costs {t}/bad.json",
        ["--controller-costs", "leave --controller-costs out"],
    ),
    ("replay --profile {t}/profile.json --traces {t}/traces --fit-overheads", ["--fit-overheads needs --bench"]),
    ("replay --profile {t}/profile.json --traces {t}/traces --output {t}/folder", ["--output", "is a folder"]),
    ("replay --profile {t}/profile.json --traces {t}/traces --batch-size 0", ["--batch-size"]),
    (
        "replay --profile {t}/profile.json --traces {t}/traces --methods plain,adaptive",
        ["traces taken with a draft model", "hf-adaspec trace --draft"],
    ),
    # export-vllm
    ("export-vllm {t}/empty {t}/profile.json", ["hf-adaspec trace --output"]),
    ("export-vllm {t}/traces /nonexistent.json", ["hf-adaspec profile --output /nonexistent.json"]),
    ("export-vllm {t}/traces {t}/profile.json --method fast", ["draft_model, ngram"]),
    ("export-vllm {t}/traces {t}/profile.json --output {t}/folder", ["--output", "is a folder"]),
    ("export-vllm {t}/traces {t}/profile.json --k-max -1", ["--k-max"]),
    # verify
    ("verify --cache {t}/file", ["--cache", "give the folder"]),
]


def assert_usage_error(result, needles: list[str]) -> str:
    """Exit code 2, no traceback, exactly one ``Error:`` line, holding every needle; returns that line."""
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.output
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.mark.parametrize(("args", "needles"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_a_usage_error_naming_the_fix(files, args, needles):
    argv = [a.replace("{t}", str(files)) for a in args.split()]
    result = CliRunner().invoke(cli.app, argv)
    assert_usage_error(result, [n.replace("{t}", str(files)) for n in needles])
    assert not (files / "work" / "benchmarks").exists()  # nothing written


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        ("generate --quantization nf5", ["nf5", "nf4"]),
        ("generate --dtype float8", ["float8", "bfloat16"]),
        ("generate --target ./no/such/model", ["no model at", "give an existing folder"]),
    ],
)
def test_names_load_refuses_are_usage_errors(tmp_path, monkeypatch, args, needles):
    """The real loader: it refuses these before loading anything."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ADASPEC_CACHE", str(tmp_path / "cache"))
    assert_usage_error(CliRunner().invoke(cli.app, args.split()), needles)


@pytest.mark.usefixtures("one_thread")
def test_a_draft_of_another_vocabulary_is_a_usage_error(tmp_path, monkeypatch, tiny_factory):
    """generate's own refusal (after loading): the message names the fix, no traceback."""
    import hf_adaspec
    from hf_adaspec import LoadedModel

    class Tokenizer:
        def apply_chat_template(self, messages, **kwargs):
            import torch

            ids = torch.tensor([[5, 6, 7, 8]])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

        def decode(self, ids, **kwargs):
            return ""

    monkeypatch.setenv("HF_ADASPEC_CACHE", str(tmp_path))
    target = LoadedModel(hf_adaspec.enable(tiny_factory(0)), Tokenizer(), "t")
    draft = LoadedModel(tiny_factory(1, vocab_size=80), None, "d")
    monkeypatch.setattr(cli, "_load_pair", lambda *args: (target, draft))
    result = CliRunner().invoke(cli.app, ["generate", "--max-new-tokens", "4", "hi"])
    assert_usage_error(result, ["vocabulary", "tokenizer"])


def test_outside_the_repository_the_defaults_still_resolve(files, monkeypatch):
    """From an empty directory bench and trace find the packaged prompts and reach the model loader."""
    reached = []

    def stop(*args, **kwargs):
        reached.append(args)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "_load_pair", stop)
    monkeypatch.setattr(trace_cli, "load_pair", stop)
    for args in (["bench"], ["bench", "--batch-size", "1,2"], ["trace", "--output", str(files / "tr")]):
        result = CliRunner().invoke(cli.app, args)
        assert result.exit_code == 0 and "Error" not in result.output, result.output
    assert len(reached) == 3


def test_a_valid_replay_still_runs(files):
    out = files / "r.json"
    result = CliRunner().invoke(
        cli.app,
        [
            "replay",
            "--profile",
            str(files / "profile.json"),
            "--traces",
            str(files / "traces"),
            "--methods",
            "plain,adaptive-lookup",
            "--output",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["prompts"] == 1 and out.is_file()
    assert Path(out.with_suffix(".md")).is_file()


def test_the_playground_without_gradio_names_the_install_before_loading_a_model(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gradio" else find(name, *a))
    result = CliRunner().invoke(cli.app, ["playground"])
    assert result.exit_code == 1 and "make playground" in result.output and "[playground]" in result.output
