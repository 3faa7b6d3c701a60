"""Converting a GGUF file parses it once (``loading._gguf_parsed_once``), and the library's reader is restored."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from hf_adaspec.models import loading


@pytest.fixture
def small_gguf(tmp_path):
    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "small")
    writer.add_tensor("t", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_each_file_is_parsed_once_inside_the_block_and_the_reader_is_restored(small_gguf, tmp_path):
    parse = gguf.GGUFReader
    with loading._gguf_parsed_once():
        first, again = gguf.GGUFReader(small_gguf), gguf.GGUFReader(str(small_gguf))
        assert first is again
        assert [t.name for t in first.tensors] == ["t"] and list(first.tensors[0].data) == list(range(8))
    assert gguf.GGUFReader is parse
    assert gguf.GGUFReader(small_gguf) is not first


def test_the_reader_is_restored_when_the_block_raises(small_gguf):
    parse = gguf.GGUFReader
    with pytest.raises(RuntimeError, match="conversion failed"), loading._gguf_parsed_once():
        gguf.GGUFReader(small_gguf)
        raise RuntimeError("conversion failed")
    assert gguf.GGUFReader is parse
