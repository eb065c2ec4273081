"""Split GGUF files (gguf-split's `-0000N-of-0000M` parts): all parts are read and the model
equals the single file; a missing part, a part of another file, a truncated part: each a
ModelLoadError naming the file."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from gguf_fixtures import split_gguf, truncated_copy
from test_gguf_file import Written, make_llm, written_cases  # noqa: F401 (fixture)
from tessellm import SamplingParams
from tessellm.errors import ModelLoadError
from tessellm.models.gguf_file import load_gguf, open_gguf
from tessellm.models.source import resolve_model_source
from tessellm.quant.formats import PackedWeight

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-split")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tessellm-cache")


@pytest.fixture(scope="module")
def single(written_cases) -> Path:
    return written_cases("llama").quantized("Q8_0")


@pytest.fixture(scope="module")
def parts(single: Path, gguf_dir: Path) -> list[Path]:
    d = gguf_dir / "model"
    d.mkdir()
    return split_gguf(single, d, 3, stem="llama-q8")


def test_every_part_is_read_and_equals_the_single_file(single: Path, parts: list[Path],
                                                       cache_dir: Path) -> None:
    whole = load_gguf(single, torch.float32, keep_packed=True)
    for named in parts:   # any part names the whole file
        split = load_gguf(named, torch.float32, keep_packed=True)
        assert split.config == whole.config and set(split.weights) == set(whole.weights)
        for name, w in whole.weights.items():
            s = split.weights[name]
            if isinstance(w, PackedWeight):
                assert torch.equal(s.data, w.data), name
            else:
                assert torch.equal(s, w), name
    assert {t.name for t in open_gguf(parts[2]).tensors} == {t.name for t in open_gguf(single).tensors}
    # a directory holding one split file is that file; its source is the first part
    assert resolve_model_source(str(parts[0].parent)).path == parts[0]
    assert resolve_model_source(str(parts[1])).path == parts[0]
    ids = [1, 403, 407, 261, 378]
    a = make_llm(single, cache_dir).generate([ids], GREEDY)[0].token_ids
    b = make_llm(parts[1], cache_dir).generate([ids], GREEDY)[0].token_ids
    assert a == b


def test_a_missing_part_is_named(parts: list[Path], tmp_path: Path) -> None:
    for p in (parts[0], parts[2]):
        shutil.copy(p, tmp_path / p.name)
    with pytest.raises(ModelLoadError, match=r"1 of its 3 parts are missing: .*llama-q8-00002-of-00003\.gguf"):
        open_gguf(tmp_path / parts[0].name)


def test_a_part_of_another_file_is_named(parts: list[Path], single: Path, written_cases,
                                         tmp_path: Path) -> None:
    # another model's split with the same part count (gguf-split stores no file identity:
    # a part of another quantization of the same model, same tensor names and shapes, cannot
    # be told apart, by llama.cpp either)
    other = split_gguf(written_cases("qwen3").quantized("Q8_0"), tmp_path, 3, stem="other")
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for p in parts:
        shutil.copy(p, mixed / p.name)
    shutil.copy(other[1], mixed / parts[1].name)
    with pytest.raises(ModelLoadError, match="llama-q8-00002-of-00003"):
        load_gguf(mixed / parts[0].name, torch.float32, keep_packed=True)
    # a part of a split into 4 parts under this name
    four = split_gguf(single, tmp_path, 4, stem="four")
    shutil.copy(four[1], mixed / parts[1].name)
    with pytest.raises(ModelLoadError, match=r"says it is part 2 of 4"):
        open_gguf(mixed / parts[0].name)


def test_a_truncated_part_is_named(parts: list[Path], tmp_path: Path) -> None:
    for p in parts:
        shutil.copy(p, tmp_path / p.name)
    cut = tmp_path / parts[2].name
    truncated_copy(parts[2], cut, parts[2].stat().st_size - 100)
    with pytest.raises(ModelLoadError, match=r"llama-q8-00003-of-00003\.gguf.*truncated"):
        open_gguf(tmp_path / parts[0].name)


def test_a_split_into_one_part_is_a_plain_file(single: Path, tmp_path: Path) -> None:
    one = tmp_path / "llama-00001-of-00001.gguf"
    shutil.copy(single, one)      # no split metadata: read as the plain file it is
    assert len(open_gguf(one).tensors) == len(open_gguf(single).tensors)
