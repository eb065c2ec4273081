"""tessellm's GGUF header reader (tessellm.models.gguf_reader) against the `gguf` package's:
the same fields (values and types) and tensors (type, shape, offsets, numpy view of the
bytes) on real and written files; a damaged header is a clear ModelLoadError."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from gguf_fixtures import STORIES_GGUF, truncated_copy
from hf_fixtures import SHARED
from tessellm.errors import ModelLoadError
from tessellm.models.gguf_reader import read_gguf
from tessellm.models.source import default_model_file

FILES = [STORIES_GGUF, default_model_file(),
         SHARED / "tokenizers" / "gguf-vocab" / "ggml-vocab-gpt-2.gguf"]


def _k_quant_file(tmp_path: Path) -> Path:
    """F32, F16, BF16, I32, Q8_0 and Q4_K tensors, arrays of every kind."""
    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, 1.5])
    w.add_array("test.strings", ["a", "", "ü"])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_bool("test.flag", True)
    w.add_float64("test.f64", 2.25)
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 32)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 64)).astype(np.float16))
    w.add_tensor("i32", np.arange(8, dtype=np.int32))
    bf16 = rng.integers(0, 2**16, (2, 32), dtype=np.uint16).view(np.uint8)
    w.add_tensor("bf16", bf16, raw_dtype=gguf.GGMLQuantizationType.BF16)
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    q4k = rng.integers(0, 256, (2, 144), dtype=np.uint8)
    w.add_tensor("q4k", q4k, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_same_as_gguf_package(path: Path) -> None:
    mine, ref = read_gguf(path), gguf.GGUFReader(path)
    assert list(mine.fields) == [k for k in ref.fields if not k.startswith("GGUF.")]
    for key, field in mine.fields.items():
        if field.types[-1] == gguf.GGUFValueType.ARRAY:   # the package flattens nested arrays
            continue
        assert field.types == ref.fields[key].types, key
        assert field.contents() == ref.fields[key].contents(), key
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(mine.tensors, ref.tensors):
        assert (a.tensor_type, list(a.shape), a.n_elements, a.n_bytes, a.data_offset) == \
            (b.tensor_type, list(b.shape), b.n_elements, b.n_bytes, b.data_offset), a.name
        assert (a.data.dtype, a.data.shape) == (b.data.dtype, b.data.shape), a.name
        assert np.array_equal(a.data.view(np.uint8), np.asarray(b.data).view(np.uint8)), a.name


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_real_files_read_as_the_gguf_package_reads_them(path: Path) -> None:
    assert_same_as_gguf_package(path)


def test_every_value_and_tensor_kind(tmp_path: Path) -> None:
    assert_same_as_gguf_package(_k_quant_file(tmp_path))
    contents = read_gguf(_k_quant_file(tmp_path))
    assert contents.fields["test.nested"].contents() == [[1, 2], [3]]
    assert contents.fields["test.strings"].contents() == ["a", "", "ü"]


def test_tensor_data_is_a_view_of_the_file(tmp_path: Path) -> None:
    contents = read_gguf(_k_quant_file(tmp_path))
    t = next(t for t in contents.tensors if t.name == "q8")
    assert not t.data.flags.owndata and t.data.base is not None


@pytest.mark.parametrize("cut", [10, 30, 200])
def test_a_header_cut_short_is_named_truncated(cut: int, tmp_path: Path) -> None:
    short = truncated_copy(STORIES_GGUF, tmp_path / "short.gguf", cut)
    with pytest.raises(ModelLoadError, match="truncated") as e:
        read_gguf(short)
    assert str(short) in str(e.value)


def test_a_tensor_past_the_end_is_named(tmp_path: Path) -> None:
    size = STORIES_GGUF.stat().st_size
    short = truncated_copy(STORIES_GGUF, tmp_path / "short.gguf", size - 64)
    with pytest.raises(ModelLoadError, match="truncated: tensor"):
        read_gguf(short)


def test_unsupported_version_and_bad_magic(tmp_path: Path) -> None:
    data = bytearray(STORIES_GGUF.read_bytes())
    data[4:8] = struct.pack("<I", 3 << 24)        # what a big-endian v3 file reads as
    (tmp_path / "be.gguf").write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="version"):
        read_gguf(tmp_path / "be.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(data[4:]))
    with pytest.raises(ModelLoadError, match="magic"):
        read_gguf(tmp_path / "bad.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty"):
        read_gguf(tmp_path / "empty.gguf")
