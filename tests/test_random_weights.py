"""Cost profiles from the architecture alone: a random-weight model built from a config has the trained
model's identity (so the profile's key matches it), the presets ship their configs, and the CLI measures
a profile with ``--random-weights`` from a folder holding only config.json."""

from __future__ import annotations

import json

import pytest
import transformers
from conftest import build_tiny_tokenizer
from typer.testing import CliRunner

from hf_adaspec.cli import cli
from hf_adaspec.costs.profile_files import load_profile, profile_identity, profile_key
from hf_adaspec.models import architecture, loading
from hf_adaspec.models.presets import DEFAULT_DRAFT, DEFAULT_TARGET


@pytest.fixture
def trained_folder(tmp_path, tiny_factory):
    """A saved tiny Llama (seed 0) with a tokenizer: what ``load`` reads."""
    folder = tmp_path / "tiny"
    tiny_factory(0).save_pretrained(folder)
    build_tiny_tokenizer().save_pretrained(folder)
    return folder


def test_random_weights_have_the_trained_models_identity(trained_folder, private_cache):
    trained = loading.load(str(trained_folder), quantization="none", dtype="float32").model
    random = architecture.load_architecture(str(trained_folder), quantization="none", dtype="float32", seed=1)
    assert profile_identity(random, None) == profile_identity(trained, None)
    assert profile_key(random, trained) == profile_key(trained, trained)
    assert not all((a == b).all() for a, b in zip(random.parameters(), trained.parameters(), strict=True))
    assert not (loading.cache_dir() / "architectures").exists()  # nothing was written to disk


def test_presets_ship_their_architectures():
    for name in (DEFAULT_TARGET, DEFAULT_DRAFT, "smollm2-135m"):
        config = transformers.AutoConfig.from_pretrained(architecture.config_path(name))
        assert config.vocab_size in (151936, 49152)
    assert transformers.AutoConfig.from_pretrained(architecture.config_path(DEFAULT_DRAFT)).vocab_size == (
        transformers.AutoConfig.from_pretrained(architecture.config_path(DEFAULT_TARGET)).vocab_size
    )
    with pytest.raises(ValueError, match="no shipped architecture for 'gemma-3-270m'.*qwen2.5-coder-0.5b"):
        architecture.config_path("gemma-3-270m")
    with pytest.raises(FileNotFoundError, match="config.json"):
        architecture.load_architecture("/nonexistent-folder")


@pytest.mark.slow  # the fast suite keeps test_random_weights_have_the_trained_models_identity, the CLI test_profile's
def test_cli_profiles_random_weights_from_a_config_folder(trained_folder, tmp_path, private_cache, one_thread):
    config_only = tmp_path / "arch"
    config_only.mkdir()
    (config_only / "config.json").write_text((trained_folder / "config.json").read_text())
    output = tmp_path / "profile.json"
    args = [
        "profile",
        "--target",
        str(config_only),
        "--draft",
        "none",
        "--quantization",
        "none",
        "--dtype",
        "float32",
        "--contexts",
        "16,32",
        "--batch-sizes",
        "1",
        "--new-tokens",
        "1,2",
        "--repeats",
        "1",
        "--random-weights",
        "--output",
        str(output),
    ]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    profile = load_profile(output)
    assert profile.meta["command"].endswith("--random-weights")
    assert profile.identity["target"]["name"] == str(config_only)
    assert json.loads(result.stdout.strip().splitlines()[-1])["output"] == str(output)
