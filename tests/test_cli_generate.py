"""`hf-adaspec generate`: every speculation mode of the library is reachable from the command line."""

from __future__ import annotations

import pytest
import torch
from conftest import slow_except
from typer.testing import CliRunner

from hf_adaspec import SPECULATION_MODES, LoadedModel
from hf_adaspec.cli import cli

pytestmark = pytest.mark.usefixtures("one_thread", "private_cache")


class _Tokenizer:
    """A chat template that always gives the same 24-token prompt; one letter per token back."""

    def apply_chat_template(self, messages, **kwargs) -> dict:
        ids = torch.tensor([[5, 6, 7, 8, 9, 10] * 4])  # [1, 24]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def decode(self, ids, **kwargs) -> str:
        return "".join(chr(97 + int(i) % 26) for i in ids)


@pytest.mark.parametrize("mode", slow_except(list(SPECULATION_MODES), fast={"adaptive"}))
def test_generate_runs_every_mode_and_prints_its_stats(mode, models, monkeypatch):
    target = LoadedModel(models["target"], _Tokenizer(), "t")
    draft = LoadedModel(models["noisy_copy"], None, "d")
    monkeypatch.setattr(cli, "_load_pair", lambda *args: (target, draft))
    result = CliRunner().invoke(cli.app, ["generate", "--speculation", mode, "--max-new-tokens", "8", "hi"])
    assert result.exit_code == 0, result.output
    assert f"[hf-adaspec] {mode}: " in result.stdout


def test_generate_names_the_modes_on_a_bad_one():
    result = CliRunner().invoke(cli.app, ["generate", "--speculation", "fast"])
    assert result.exit_code != 0
    text = " ".join(result.output.replace("│", " ").split())
    assert "adaptive" in text and "fixed" in text and "off" in text


def test_generate_drafts_with_a_head_folder(models, tiny_head, tmp_path, monkeypatch):
    from hf_adaspec import save_head

    folder = save_head(tiny_head, tmp_path / "head")
    target = LoadedModel(models["target"], _Tokenizer(), "t")
    asked = []
    monkeypatch.setattr(cli, "_load_pair", lambda t, d, *args: asked.append(d) or (target, None))
    result = CliRunner().invoke(cli.app, ["generate", "--head", str(folder), "--max-new-tokens", "8", "hi"])
    assert result.exit_code == 0, result.output
    assert asked == ["none"] and "[hf-adaspec] adaptive: " in result.stdout  # no draft model loaded beside the head
    missing = CliRunner().invoke(cli.app, ["generate", "--head", str(tmp_path / "nope"), "hi"])
    assert (
        missing.exit_code == 2 and "speculators-format folder" in missing.output and "Traceback" not in missing.output
    )
