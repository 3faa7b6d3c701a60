"""``hf-adaspec check-files`` (once ``verify``, an alias for one release) and ``load(..., verify=True)``: the
full SHA-256 check that the cheap stat check (size and mtime) cannot give. A byte corrupted with the file's size and
mtime kept passes the stat check and fails the full one, which names the fix. Temporary caches, a fake GGUF and a
tiny model only (no downloads)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import transformers
from conftest import build_tiny_tokenizer
from typer.testing import CliRunner

from hf_adaspec.cli import check_files_cli, cli
from hf_adaspec.costs.predictors import ProfileCell
from hf_adaspec.costs.profile import assemble_profile
from hf_adaspec.costs.profile_files import save_profile
from hf_adaspec.costs.table import CostTable
from hf_adaspec.files import check_files, write_json_verified
from hf_adaspec.models import assets, loading
from hf_adaspec.models.assets import GgufAsset

pytestmark = pytest.mark.usefixtures("one_thread")
DATA = b"GGUF" + bytes(range(256)) * 64
META = {
    "versions": {},
    "machine": "",
    "cpu": "",
    "threads": 1,
    "created": "",
    "command": "hf-adaspec profile --quick",
    "grid": {},
}


def _corrupt_keeping_size_and_mtime(path: Path, offset: int | None = None) -> None:
    """Flip one byte of ``path`` in place, then restore its mtime: the stat check cannot see it."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns


@pytest.fixture
def cache(tmp_path, monkeypatch, tiny_factory):
    """A cache with one entry of each kind: an assembled GGUF (from two fake parts), the dense copy of
    ``tiny.gguf`` (transformers' GGUF loader replaced by the tiny Llama), a cost table and a profile.
    Returns (cache root, the GGUF asset, the tiny.gguf path)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("HF_ADASPEC_CACHE", str(root))
    part1, part2 = tmp_path / "p1.bin", tmp_path / "p2.bin"
    part1.write_bytes(DATA[:1000])
    part2.write_bytes(DATA[1000:])
    monkeypatch.setattr(assets, "locate_parts", lambda asset: [part1, part2])
    asset = GgufAsset("tiny-parts.gguf", ("p1", "p2"), ".bin", sha256=hashlib.sha256(DATA).hexdigest())
    assets.assemble(asset)
    model_load, tokenizer_load = (
        transformers.AutoModelForCausalLM.from_pretrained,
        transformers.AutoTokenizer.from_pretrained,
    )
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM,
        "from_pretrained",
        lambda *a, gguf_file=None, **k: tiny_factory(0) if gguf_file else model_load(*a, **k),
    )
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda *a, gguf_file=None, **k: build_tiny_tokenizer() if gguf_file else tokenizer_load(*a, **k),
    )
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(DATA)
    loading.resolve(str(gguf), "float32")
    table = CostTable(verify_ms=(10.0, 11.0), draft_ms=1.0)
    write_json_verified(root / "costs" / "pair.json", {**asdict(table), "verify_ms": list(table.verify_ms)})
    cells = {"target": [ProfileCell(1, c, n, 20.0 + n + c / 100) for c in (16, 64) for n in (1, 2, 4)]}
    save_profile(assemble_profile("tiny", {"target": {"name": "t"}}, cells, META), root / "profiles" / "p.json")
    return root, asset, gguf


def _check(root: Path, command: str = "check-files"):
    result = CliRunner().invoke(cli.app, [command, "--cache", str(root)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    return result, json.loads(result.stdout.strip().splitlines()[-1])


def _dense(root: Path) -> Path:
    (folder,) = (root / "dense").iterdir()
    return folder


def test_an_intact_cache_verifies_ok_one_line_per_entry(cache):
    root, _, _ = cache
    result, summary = _check(root)
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()[:-1]
    assert len(lines) == 4 and all(line.startswith("ok ") for line in lines)
    assert [line.split()[1] for line in lines] == ["gguf", "dense", "costs", "profiles"]
    assert summary == {"cache": str(root), "entries": 4, "ok": 4, "failed": []}


def test_a_corrupted_dense_file_passes_the_stat_check_fails_check_files_and_is_rebuilt_by_load_verify(cache):
    root, _, gguf = cache
    dense = _dense(root)
    _corrupt_keeping_size_and_mtime(dense / "model.safetensors")
    assert check_files(dense, dense / loading._DONE) is None  # the cheap check is fooled
    assert loading._dense_ok(dense)
    result, summary = _check(root)
    assert result.exit_code == 1
    (failed,) = summary["failed"]
    assert failed["path"] == str(dense) and "SHA-256 differs" in failed["problem"]
    assert f"rm -r {dense}" in failed["fix"] and "rebuilds it" in failed["fix"]
    assert f"FAILED  dense    {dense}: model.safetensors was modified" in result.stdout
    assert loading.resolve(str(gguf), "float32") == str(dense)  # the stat check still trusts it
    assert check_files(dense, dense / loading._DONE, full=True) is not None
    loading.load(str(gguf), quantization="none", dtype="float32", verify=True)  # the full check rebuilds it
    assert check_files(dense, dense / loading._DONE, full=True) is None
    assert _check(root)[0].exit_code == 0


@pytest.mark.slow  # the fast suite keeps the dense file's case of the same check (and test_faults' reassembly)
def test_a_corrupted_assembled_gguf_fails_check_files_and_assemble_verify_reassembles_it(cache):
    root, asset, _ = cache
    path = root / "gguf" / asset.filename
    _corrupt_keeping_size_and_mtime(path, offset=600)
    assert assets.assemble(asset).read_bytes() != DATA  # the stat check trusts it
    result, summary = _check(root)
    assert result.exit_code == 1 and [f["kind"] for f in summary["failed"]] == ["gguf"]
    assert f"rm {path} {path}.stamp" in summary["failed"][0]["fix"]
    assert assets.assemble(asset, verify=True).read_bytes() == DATA
    assert _check(root)[0].exit_code == 0


@pytest.mark.parametrize(
    ("folder", "fix"), [("costs", "calibrates the pair again"), ("profiles", "re-run `hf-adaspec profile --quick`")]
)
def test_a_corrupted_cost_table_or_profile_fails_check_files_naming_the_fix(cache, folder, fix):
    root, _, _ = cache
    (path,) = (root / folder).glob("*.json")
    text = path.read_text()
    path.write_text(text.replace("1", "7", 1))  # one digit changed: the digest no longer matches
    result, summary = _check(root)
    assert result.exit_code == 1
    (failed,) = summary["failed"]
    assert failed["path"] == str(path) and "digest" in failed["problem"] and fix in failed["fix"]
    assert f"rm {path}" in failed["fix"]


def test_missing_or_empty_cache_has_nothing_to_check(tmp_path):
    result, summary = _check(tmp_path / "none")
    assert result.exit_code == 0 and "nothing to check" in result.stdout
    assert summary["entries"] == 0 and summary["failed"] == []


def test_a_file_given_as_the_cache_is_a_usage_error(tmp_path):
    (tmp_path / "f").write_text("x")
    result = CliRunner().invoke(cli.app, ["check-files", "--cache", str(tmp_path / "f")])
    assert result.exit_code == 2 and "give the folder with --cache" in result.output
    assert "Traceback" not in result.output


def test_temporaries_and_stamps_are_not_entries(cache):
    root, _, _ = cache
    (root / "costs" / "pair.json.tmp-999999-abcd").write_text("half")
    _, summary = _check(root)
    assert summary["entries"] == 4


def test_verify_is_an_alias_for_one_release_saying_so_on_stderr(cache):
    root, _, _ = cache
    old, summary = _check(root, "verify")
    new, _ = _check(root)
    assert old.exit_code == 0 and old.stdout == new.stdout and summary["entries"] == 4
    assert old.stderr.strip() == check_files_cli.RENAMED and new.stderr == ""
    assert "hf-adaspec check-files" in old.stderr and "next release" in old.stderr
    help_text = CliRunner().invoke(cli.app, ["--help"]).stdout
    assert "check-files" in help_text and " verify " not in help_text  # hidden from --help
