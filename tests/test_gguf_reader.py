"""The GGUF reader with fast arrays (core/engine/gguf_reader.py) against gguf-py's own GGUFReader: the same
fields (offsets, parts, data indices, types, contents) and tensors, on the real SmolLM2 file and on a written
file with every kind of array; a file cut inside a string array is refused."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from specpilot.core.engine.gguf_checkpoint import GGUFError, reader
from specpilot.core.engine.gguf_reader import FastArraysReader


def _same(path) -> None:
    ours, theirs = FastArraysReader(str(path), "r"), GGUFReader(str(path), "r")
    assert list(ours.fields) == list(theirs.fields)
    for key, a in theirs.fields.items():
        b = ours.fields[key]
        assert (b.offset, b.name, b.data, b.types) == (a.offset, a.name, a.data, a.types), key
        assert len(b.parts) == len(a.parts), key
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), key
        assert b.contents() == a.contents(), key
        if a.data:
            assert b.contents(len(a.data) - 1) == a.contents(len(a.data) - 1), key
    assert ours.data_offset == theirs.data_offset
    assert [(t.name, int(t.tensor_type), t.shape.tolist(), t.data_offset) for t in ours.tensors] == \
        [(t.name, int(t.tensor_type), t.shape.tolist(), t.data_offset) for t in theirs.tensors]
    for x, y in zip(theirs.tensors, ours.tensors):
        assert np.array_equal(x.data, y.data)


def test_the_real_file_reads_as_gguf_py_reads_it(smollm2_gguf):
    _same(smollm2_gguf)
    tokens = reader(smollm2_gguf).fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) > 40000 and tokens.types == [GGUFValueType.ARRAY, GGUFValueType.STRING]


def _write(path, arrays: dict) -> None:
    w = GGUFWriter(str(path), "llama")
    for key, (values, vtype) in arrays.items():
        w.add_array(key, values) if vtype is None else w.add_key_value(key, values, GGUFValueType.ARRAY,
                                                                       sub_type=vtype)
    w.add_tensor("token_embd.weight", np.arange(96, dtype=np.float32).reshape(12, 8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_every_kind_of_array_reads_as_gguf_py_reads_it(tmp_path):
    path = tmp_path / "arrays.gguf"
    _write(path, {
        "strings": (["a", "", "ünï", "x" * 300], None),
        "empty": ([], None),
        "ints": ([1, -2, 3], GGUFValueType.INT32),
        "u8": ([0, 255], GGUFValueType.UINT8),
        "u64": ([2 ** 40, 7], GGUFValueType.UINT64),
        "floats": ([0.5, -1.25], GGUFValueType.FLOAT32),
        "f64": ([1e300], GGUFValueType.FLOAT64),
        "bools": ([True, False, True], GGUFValueType.BOOL),
        "nested": ([[1, 2], [3]], None),
    })
    _same(path)
    assert FastArraysReader(str(path), "r").fields["strings"].contents() == ["a", "", "ünï", "x" * 300]


def test_a_file_cut_inside_a_string_array_is_refused(tmp_path, smollm2_gguf):
    tokens = GGUFReader(smollm2_gguf, "r").fields["tokenizer.ggml.tokens"]
    middle = tokens.offset + sum(int(p.nbytes) for p in tokens.parts) // 2
    cut = tmp_path / "cut.gguf"
    with open(smollm2_gguf, "rb") as src:
        cut.write_bytes(src.read(middle))
    with pytest.raises(GGUFError, match="truncated or corrupt"):
        reader(cut)
