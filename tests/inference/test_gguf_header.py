"""inference/gguf_header.py against the gguf package's GGUFReader, the format's reference reader: the same
metadata, tensor index and tensor bytes, with the vocabulary arrays stepped over; and a clear error for a
file it cannot read."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from test_gguf import write_gguf
from test_gguf_packed import EVERY_TYPE
from tiny_models import make_tiny_model

from inference.gguf_files import bundled_model
from inference.gguf_header import read_header
from inference.gguf_loader import VOCABULARY_ARRAYS


@pytest.fixture(scope="module")
def every_type_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("header")
    hf_dir = make_tiny_model(root / "hf", "qwen2", hidden_size=256, intermediate_size=256)
    return write_gguf(hf_dir, root / "every-type.gguf", EVERY_TYPE, sampling={"temp": 0.6, "top_k": 20})


def assert_reads_as_gguf_reader(path) -> None:
    header = read_header(str(path), skipped=VOCABULARY_ARRAYS)
    reference = GGUFReader(str(path))
    kept = {key: field.contents() for key, field in reference.fields.items() if key not in VOCABULARY_ARRAYS}
    assert header.fields == kept
    assert header.lengths == {k: len(f.data) for k, f in reference.fields.items() if k in VOCABULARY_ARRAYS}
    assert header.data_offset == reference.data_offset
    assert [t.name for t in header.tensors] == [t.name for t in reference.tensors]
    for ours, theirs in zip(header.tensors, reference.tensors):
        assert ours.tensor_type == theirs.tensor_type
        assert ours.shape == tuple(int(d) for d in theirs.shape)
        assert (ours.n_bytes, ours.data_offset) == (theirs.n_bytes, theirs.data_offset)
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)


def test_every_tensor_type_and_metadata_as_gguf_reader(every_type_file):
    assert_reads_as_gguf_reader(every_type_file)
    header = read_header(str(every_type_file), skipped=VOCABULARY_ARRAYS)
    assert {t.tensor_type.name for t in header.tensors} >= set(EVERY_TYPE)
    assert header.fields["general.sampling.top_k"] == 20 and header.lengths["tokenizer.ggml.merges"] > 0


def test_the_default_models_file_as_gguf_reader():
    assert_reads_as_gguf_reader(bundled_model())


def test_arrays_of_every_value_type(tmp_path):
    path = tmp_path / "arrays.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_array("test.strings", ["a", "ünï", ""])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.bools", [True, False])
    writer.add_array("test.nested", [[1, 2], [3]])
    writer.add_array("test.skipped_nested", [["x"], ["y", "z"]])
    writer.add_uint64("test.big", 2**63 + 5)
    writer.add_float64("test.double", 1 / 3)
    writer.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    header = read_header(str(path), skipped=("test.strings", "test.skipped_nested"))
    assert header.lengths == {"test.strings": 3, "test.skipped_nested": 2}
    assert header.fields["test.ints"] == [1, -2, 3] and header.fields["test.floats"] == [0.5, -1.25]
    assert header.fields["test.bools"] == [True, False] and header.fields["test.nested"] == [[1, 2], [3]]
    assert header.fields["test.big"] == 2**63 + 5 and header.fields["test.double"] == 1 / 3
    assert np.array_equal(header.tensors[0].data, np.arange(6, dtype=np.float32).reshape(2, 3))


def test_a_file_it_cannot_read_is_an_error_naming_it(every_type_file, tmp_path):
    raw = every_type_file.read_bytes()
    header_end = read_header(str(every_type_file)).data_offset
    cases = {
        "not-gguf": (b"GGML" + raw[4:], "no GGUF magic"),
        "version-1": (raw[:4] + struct.pack("<I", 1) + raw[8:], "GGUF version 1 is not supported"),
        "big-endian": (raw[:4] + struct.pack(">I", 3) + raw[8:], "big-endian"),
        "truncated": (raw[: header_end // 2], "truncated or corrupt header"),
        "tensors-cut": (raw[: header_end + 100], "ends past the end of the file"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message) as caught:
            read_header(str(path))
        assert str(path) in str(caught.value)
