"""The GGUF header reader gives what gguf's own ``GGUFReader`` gives, field for field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from shared.gguf_file import GGUFFile
from shared.registry import smollm2_gguf_path

FLATTENED_BY_GGUF = {"nested"}  # gguf's reader flattens an array of arrays


def assert_same_as_gguf(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), GGUFReader(path)
    fields = {key: field.contents() for key, field in theirs.fields.items()}
    fields |= {key: ours.metadata[key] for key in FLATTENED_BY_GGUF & fields.keys()}
    assert ours.metadata == {k: v for k, v in fields.items() if not k.startswith("GGUF.")}
    for key, value in ours.metadata.items():
        assert type(value) is type(fields[key]), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == reference.tensor_type
        assert mine.shape == tuple(reference.shape.tolist())
        assert mine.data.dtype == reference.data.dtype
        assert np.array_equal(mine.data, reference.data), mine.name
    return ours


def test_the_default_model_s_header_and_tensors() -> None:
    ours = assert_same_as_gguf(smollm2_gguf_path())
    assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
    assert not ours.tensors[0].data.flags.writeable  # a view of the mapped file


def test_every_value_type_and_tensor_layout(tmp_path: Path) -> None:
    path = tmp_path / "all.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("u8", 7)
    writer.add_int8("i8", -7)
    writer.add_uint16("u16", 65535)
    writer.add_int16("i16", -300)
    writer.add_uint32("u32", 4_000_000_000)
    writer.add_int32("i32", -5)
    writer.add_float32("f32", 0.25)
    writer.add_uint64("u64", 2**40)
    writer.add_int64("i64", -(2**40))
    writer.add_float64("f64", 1e-300)
    writer.add_bool("yes", True)
    writer.add_string("text", "héllo ✓")
    writer.add_array("ints", [1, 2, 3])
    writer.add_array("words", ["a", "", "日本"])
    writer.add_array("nested", [[1, 2], [3]])
    rows = np.arange(4 * 64, dtype=np.float32).reshape(4, 64) / 7
    writer.add_tensor("f32", rows)
    writer.add_tensor("f16", rows.astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q8 = quantize(rows, GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = assert_same_as_gguf(path)
    assert ours.metadata["words"] == ["a", "", "日本"] and ours.metadata["yes"] is True
    assert ours.metadata["nested"] == [[1, 2], [3]]
    assert ours.tensors[-1].data.shape == q8.shape


@pytest.mark.parametrize(
    "content", [b"", b"GGUF", b"NOPE" + bytes(20), b"GGUF\x03\0\0\0" + b"\xff" * 8]
)
def test_a_file_that_is_not_gguf_is_a_value_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="bad.gguf"):
        GGUFFile(path)
