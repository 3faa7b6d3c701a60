"""Converting a GGUF file parses it once (``loading._gguf_parsed_once``) over a plain array view of its map, into
the fields and tensors gguf's own reader gives, and the library's reader is restored."""

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
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "", "déf"])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.0, 2.0, 0.0])
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


def test_the_block_parses_the_same_fields_and_tensor_bytes_as_gguf_over_a_plain_array(small_gguf):
    plain = gguf.GGUFReader(small_gguf)
    with loading._gguf_parsed_once():
        fast = gguf.GGUFReader(small_gguf)
    assert type(fast.data) is np.ndarray and type(plain.data) is np.memmap
    assert list(fast.fields) == list(plain.fields)
    assert all(fast.fields[k].contents() == plain.fields[k].contents() for k in plain.fields)
    assert fast.fields["tokenizer.ggml.tokens"].contents() == ["a", "bc", "", "déf"]
    assert [(t.name, t.data.tolist()) for t in fast.tensors] == [(t.name, t.data.tolist()) for t in plain.tensors]


def test_the_reader_is_restored_when_the_block_raises(small_gguf):
    parse = gguf.GGUFReader
    with pytest.raises(RuntimeError, match="conversion failed"), loading._gguf_parsed_once():
        gguf.GGUFReader(small_gguf)
        raise RuntimeError("conversion failed")
    assert gguf.GGUFReader is parse
