"""Faults and bad input (issue 27's table): corrupted or truncated cache entries are rebuilt, NaN and
implausible costs are refused, a folder where a cost table belongs does not break generate, unknown
model names fail at once offline, the first-use calibration stays small for any k, and a writer killed
mid-write (model assembly, dense conversion, profile) leaves nothing that is mistaken for an entry and
nothing that survives the next run. Tiny models and temporary caches only."""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from conftest import build_tiny_tokenizer, slow_except

import hf_adaspec
from hf_adaspec.costs import table as cost_table
from hf_adaspec.costs.predictors import ProfileCell
from hf_adaspec.costs.profile import assemble_profile
from hf_adaspec.costs.profile_files import profile_identity, save_profile
from hf_adaspec.files import (
    TMP_MARK,
    read_stamp,
    sha256_file,
    sweep,
    write_json_verified,
)
from hf_adaspec.models import assets, loading
from hf_adaspec.models.assets import GgufAsset

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parent.parent
PROMPT = torch.tensor([[3, 4, 5, 3, 4, 5, 6, 7]])  # [1, 8]
DATA = b"GGUF" + bytes(range(256)) * 64


def _temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if TMP_MARK in p.name) if folder.exists() else []


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch, tiny_factory):
    """A ``tiny.gguf`` whose 'conversion' yields the tiny Llama of seed 0 (transformers' GGUF loader is
    replaced; the rest of ``_dense_from_gguf`` runs as is). Returns (path, conversion count list)."""
    monkeypatch.setenv("HF_ADASPEC_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(DATA)
    conversions = []
    model_load = transformers.AutoModelForCausalLM.from_pretrained
    tokenizer_load = transformers.AutoTokenizer.from_pretrained

    def model(*args, gguf_file=None, **kwargs):
        if gguf_file is None:
            return model_load(*args, **kwargs)
        conversions.append(gguf_file)
        return tiny_factory(0)

    def tokenizer(*args, gguf_file=None, **kwargs):
        return build_tiny_tokenizer() if gguf_file else tokenizer_load(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)
    return gguf, conversions


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits


# --- verify what you load ----------------------------------------------------------------------------------


# fast: flip (same size: only the hash finds it); truncate and delete are slow
@pytest.mark.parametrize("damage", slow_except(["flip", "truncate", "delete"], fast={"flip"}))
def test_damaged_dense_cache_is_rebuilt(fake_gguf, tiny_factory, damage, capsys):
    gguf, conversions = fake_gguf
    dense = Path(loading.resolve(str(gguf), "float32"))
    weights = dense / "model.safetensors"
    stamp = {s.name: s for s in read_stamp(dense / loading._DONE)}
    assert stamp["model.safetensors"].sha256 == sha256_file(weights)
    data = bytearray(weights.read_bytes())
    if damage == "flip":  # same size, other bytes, the stamp kept
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 64])
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 3]))
    else:
        weights.unlink()
    assert loading.resolve(str(gguf), "float32") == str(dense) and len(conversions) == 2
    assert "is not what was written" in capsys.readouterr().err
    loaded = loading.load(str(gguf), quantization="none", dtype="float32")
    assert torch.equal(_logits(loaded.model), _logits(tiny_factory(0)))
    assert loading.resolve(str(gguf), "float32") == str(dense) and len(conversions) == 2  # now trusted again


def test_dense_cache_of_an_older_version_is_rebuilt(fake_gguf):
    gguf, conversions = fake_gguf
    dense = Path(loading.resolve(str(gguf), "float32"))
    (dense / loading._DONE).write_text(gguf.name + "\n")  # the old completion stamp: no sizes, no hashes
    loading.resolve(str(gguf), "float32")
    assert len(conversions) == 2 and read_stamp(dense / loading._DONE)


def test_damaged_assembled_gguf_is_reassembled(tmp_path, monkeypatch, capsys):
    part1, part2 = tmp_path / "p1.bin", tmp_path / "p2.bin"
    part1.write_bytes(DATA[:1000])
    part2.write_bytes(DATA[1000:])
    monkeypatch.setattr(assets, "locate_parts", lambda asset: [part1, part2])
    asset = GgufAsset("tiny.gguf", ("p1", "p2"), ".bin", sha256=hashlib.sha256(DATA).hexdigest())
    dest = assets.assemble(asset, root=tmp_path)
    dest.write_bytes(DATA[:500] + b"\x00" * 8 + DATA[508:])  # flipped, same size
    assert assets.assemble(asset, root=tmp_path).read_bytes() == DATA
    assert "modified after it was written (SHA-256 differs)); assembling it again" in capsys.readouterr().err
    dest.write_bytes(DATA[:10])  # truncated
    assert assets.assemble(asset, root=tmp_path).read_bytes() == DATA


@pytest.fixture
def enabled(tiny_factory):
    return hf_adaspec.enable(tiny_factory(0)), tiny_factory(1)


def _calibrated_file(cache: Path) -> Path:
    files = list((cache / "costs").glob("*.json"))
    assert len(files) == 1
    return files[0]


def _generate(model, draft, **kwargs):
    return model.generate(
        PROMPT,
        max_new_tokens=12,
        do_sample=False,
        speculation="adaptive",
        assistant_model=draft,
        max_speculative_tokens=3,
        speculation_state=hf_adaspec.SpeculationState(),
        **kwargs,
    )


# fast: NaN; a negative and an implausibly large time are slow
@pytest.mark.parametrize(
    "value", [float("nan"), pytest.param(-5.0, marks=pytest.mark.slow), pytest.param(1e12, marks=pytest.mark.slow)]
)
def test_cost_table_with_bad_values_is_measured_again(enabled, private_cache, tmp_path, value, capsys):
    model, draft = enabled
    expected = model.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(_generate(model, draft), expected)
    path = _calibrated_file(tmp_path)
    data = json.loads(path.read_text())
    data["verify_ms"][1] = value
    write_json_verified(path, {k: v for k, v in data.items() if k != "digest"})  # a valid digest, bad values
    assert torch.equal(_generate(model, draft), expected)
    assert "ignoring cost table" in capsys.readouterr().err
    assert all(math.isfinite(t) and 0 < t < 1e5 for t in json.loads(path.read_text())["verify_ms"])


@pytest.mark.slow  # the fast suite keeps test_cost_table_with_bad_values_is_measured_again[nan] (and the digest
# check in test_profile_scaled_a_million_times_is_refused)
def test_cost_table_edited_by_hand_is_measured_again(enabled, private_cache, tmp_path, capsys):
    model, draft = enabled
    _generate(model, draft)
    path = _calibrated_file(tmp_path)
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "draft_ms": data["draft_ms"] * 1e6}))  # the digest no longer matches
    _generate(model, draft)
    assert "digest does not match" in capsys.readouterr().err
    assert json.loads(path.read_text())["draft_ms"] == pytest.approx(data["draft_ms"], rel=10)


def test_cost_table_path_that_is_a_folder_still_generates(enabled, private_cache, tmp_path, capsys):
    model, draft = enabled
    expected = model.generate(PROMPT, max_new_tokens=12, do_sample=False)
    _generate(model, draft)
    path = _calibrated_file(tmp_path)
    path.unlink()
    path.mkdir()
    assert torch.equal(_generate(model, draft), expected)
    err = capsys.readouterr().err
    assert "could not cache the cost table" in err and f"rm -r {path}" in err


def _profile_for(target, draft, scale: float = 1.0):
    cells = [ProfileCell(1, c, n, scale * (20.0 + n + c / 100)) for c in (16, 64) for n in (1, 2, 4)]
    draft_cells = [ProfileCell(1, c, n, scale * (2.0 + n / 10)) for c in (16, 64) for n in (1, 32)]
    return assemble_profile(
        "tiny",
        profile_identity(target, draft),
        {"target": cells, "draft": draft_cells},
        {"versions": {}, "machine": "", "cpu": "", "threads": 1, "created": "", "command": "", "grid": {}},
    )


def test_profile_scaled_a_million_times_is_refused(enabled, tmp_path):
    model, draft = enabled
    path = save_profile(_profile_for(model, draft), tmp_path / "p.json")
    data = json.loads(path.read_text())
    for name in ("target_cells", "draft_cells"):
        for cell in data[name]:
            cell["median_ms"] *= 1e6
            cell["samples"] = [s * 1e6 for s in cell["samples"]]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"digest does not match.*re-run `hf-adaspec profile`"):
        _generate(model, draft, speculation_profile=str(path))
    write_json_verified(path, {k: v for k, v in data.items() if k != "digest"})  # digest recomputed
    with pytest.raises(ValueError, match=r"must be finite and in.*re-run `hf-adaspec profile`"):
        _generate(model, draft, speculation_profile=str(path))


# --- bounds and names ------------------------------------------------------------------------------------


def test_first_use_calibration_is_sized_whatever_k_is(tiny_factory, monkeypatch):
    timed = []
    real = cost_table.ForwardProbe.time_ms
    monkeypatch.setattr(
        cost_table.ForwardProbe, "time_ms", lambda self, n, keep=None: timed.append(n) or real(self, n, keep)
    )
    table = cost_table.measure(tiny_factory(0), None, n_max=65, repeats=1)
    assert set(timed) == set(cost_table.CALIBRATED_NS) and max(timed) == 32
    assert table.max_tokens == 32 and table.t_verify(65) >= table.t_verify(32) > 0
    assert cost_table.calibrated_ns(6) == (1, 2, 3, 4, 5, 6) and cost_table.calibrated_ns(11) == (
        1,
        2,
        3,
        4,
        5,
        6,
        7,
        8,
        9,
        11,
    )


def test_speculative_token_bounds_are_refused(enabled):
    model, draft = enabled
    with pytest.raises(ValueError, match=r"max_speculative_tokens must be in \[1, 64\]"):
        model.generate(
            PROMPT, max_new_tokens=4, speculation="adaptive", assistant_model=draft, max_speculative_tokens=10_000
        )
    with pytest.raises(ValueError, match=r"num_speculative_tokens must be in \[0, 64\]"):
        model.generate(PROMPT, max_new_tokens=4, speculation="fixed", num_speculative_tokens=65)


@pytest.fixture
def offline(monkeypatch):
    def no_network(*args, **kwargs):
        raise OSError("network is unreachable (test)")

    def no_hub(*args, **kwargs):
        raise AssertionError("transformers must not be asked to download")

    monkeypatch.setattr(socket, "create_connection", no_network)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_hub)


@pytest.mark.parametrize("name", ["qwen-coder-1.5b", "someone/no-such-model"])
def test_unknown_name_offline_fails_at_once_listing_presets(offline, private_cache, name):
    with pytest.raises(ValueError, match="qwen2.5-coder-1.5b.*unreachable") as err:
        loading.load(name)
    assert name in str(err.value) and "smollm2-135m" in str(err.value)


def test_hf_hub_offline_fails_at_once(private_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(socket, "create_connection", lambda *a, **k: pytest.fail("offline mode must not probe"))
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE"):
        loading.resolve("no-such-model")


@pytest.mark.parametrize("name", ["./missing-model", "/nonexistent/dir", "~/no/such/model"])
def test_missing_local_path_names_the_presets(offline, name):
    with pytest.raises(FileNotFoundError, match="qwen2.5-coder-1.5b"):
        loading.resolve(name)


# --- nothing left behind ----------------------------------------------------------------------------------


def test_sweep_keeps_live_writers_and_removes_dead_ones(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f"a.json{TMP_MARK}{dead_pid}-ab12").write_text("half")
    (tmp_path / f"d{TMP_MARK}{dead_pid}-cd34").mkdir()
    (tmp_path / f"d{TMP_MARK}{dead_pid}-cd34" / "x").write_text("half")
    live = tmp_path / f"b.json{TMP_MARK}{os.getpid()}-ef56"
    live.write_text("being written")
    (tmp_path / "c.json").write_text("{}")
    assert sorted(p.name for p in sweep(tmp_path)) == [
        f"a.json{TMP_MARK}{dead_pid}-ab12",
        f"d{TMP_MARK}{dead_pid}-cd34",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "c.json"])


_WRITER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import hf_adaspec.files as files

    def stall(fd):  # reached inside files.atomic_write, the data written, before the rename
        print("writing", flush=True)
        time.sleep(60)

    files.os.fsync = stall
    job, root = sys.argv[1], Path(sys.argv[2])
    if job == "assemble":
        from hf_adaspec.models import assets
        parts = [root / "p1.bin", root / "p2.bin"]
        assets.locate_parts = lambda asset: parts
        assets.assemble(assets.GgufAsset("tiny.gguf", ("p1", "p2"), ".bin", sys.argv[3]), root=root / "cache")
    elif job == "convert":
        import torch, transformers
        sys.path.insert(0, sys.argv[3])
        from conftest import build_tiny_llama, build_tiny_tokenizer
        transformers.AutoModelForCausalLM.from_pretrained = lambda *a, **k: build_tiny_llama(0)
        transformers.AutoTokenizer.from_pretrained = lambda *a, **k: build_tiny_tokenizer()
        from hf_adaspec.models import loading
        loading.resolve(str(root / "tiny.gguf"), "float32")
    else:
        from hf_adaspec.costs.profile_files import load_profile, save_profile
        save_profile(load_profile(root / "good.json"), root / "profiles" / "p.json")
""")


@pytest.mark.slow  # three subprocesses, each importing torch and transformers: ~12 s on 2 cores
def test_writers_killed_mid_write_leave_nothing_behind(tmp_path, tiny_factory, monkeypatch, fake_gguf):
    """Assembly, dense conversion and a profile save each killed (SIGKILL) mid-write: no final entry
    exists, the temporary is findable by name, and the next run builds the entry and removes it."""
    gguf, conversions = fake_gguf
    (tmp_path / "p1.bin").write_bytes(DATA[:1000])
    (tmp_path / "p2.bin").write_bytes(DATA[1000:])
    sha = sha256_file(gguf)
    good = save_profile(_profile_for(tiny_factory(0), tiny_factory(1)), tmp_path / "good.json")
    env = {**os.environ, "HF_ADASPEC_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    jobs = {"assemble": [sha], "convert": [str(ROOT / "tests")], "profile": []}
    procs = {
        job: subprocess.Popen(
            [sys.executable, "-c", _WRITER, job, str(tmp_path), *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for job, extra in jobs.items()
    }
    for job, proc in procs.items():
        line = proc.stdout.readline()
        assert line == "writing\n", (job, line, proc.stderr.read() if proc.poll() is not None else "")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    folders = {
        "assemble": tmp_path / "cache" / "gguf",
        "convert": tmp_path / "cache" / "dense",
        "profile": tmp_path / "profiles",
    }
    for job, folder in folders.items():
        assert len(_temporaries(folder)) == 1, job
        assert not [p for p in folder.iterdir() if TMP_MARK not in p.name], job  # no entry, no stamp
    monkeypatch.setattr(assets, "locate_parts", lambda asset: [tmp_path / "p1.bin", tmp_path / "p2.bin"])
    asset = GgufAsset("tiny.gguf", ("p1", "p2"), ".bin", sha)
    assert assets.assemble(asset, root=tmp_path / "cache").read_bytes() == DATA
    dense = Path(loading.resolve(str(gguf), "float32"))
    assert (dense / "model.safetensors").exists() and conversions == ["tiny.gguf"]
    save_profile(_profile_for(tiny_factory(0), tiny_factory(1)), tmp_path / "profiles" / "p.json")
    assert all(_temporaries(folder) == [] for folder in folders.values())
    assert good.exists()


def test_cli_names_an_unknown_model_without_a_traceback(offline, private_cache):
    from typer.testing import CliRunner

    from hf_adaspec.cli import cli

    result = CliRunner().invoke(cli.app, ["generate", "--target", "no-such-model", "--max-new-tokens", "2"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "'no-such-model' is not a preset" in " ".join(result.output.replace("│", " ").split())
