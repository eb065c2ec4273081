"""Tests for tessellm.models.hf_files against the real stories260K checkpoint."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessellm.errors import ModelLoadError
from tessellm.models.hf_files import eos_token_ids, load_safetensors, read_hf_config
from tessellm.models.source_tokenizer import load_tokenizer

STORIES = Path("/work/shared/models/stories260K-hf")
pytestmark = pytest.mark.skipif(not STORIES.is_dir(), reason="stories260K-hf not available")


@pytest.fixture(scope="module")
def reference() -> dict[str, torch.Tensor]:
    return load_file(str(STORIES / "model.safetensors"))


def _sharded_copy(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Copy the non-weight files and split the tensors over two shards with an index."""
    dst.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json",
                 "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map: dict[str, str] = {}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(dst / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in keys})
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return weight_map


def test_read_config_with_generation_config() -> None:
    config = read_hf_config(STORIES)
    assert config["model_type"] == "llama"
    assert config["_generation_config"]["eos_token_id"] == 2


def test_read_config_missing(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="config.json"):
        read_hf_config(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_hf_config(tmp_path / "nope")


def test_read_config_malformed(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="cannot read"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_load_single_file_converts(dtype: torch.dtype, reference: dict[str, torch.Tensor]) -> None:
    tensors = load_safetensors(STORIES, dtype, progress=False)
    assert tensors.keys() == reference.keys()
    for name, tensor in tensors.items():
        assert tensor.dtype == dtype, name
        torch.testing.assert_close(tensor, reference[name].to(dtype), rtol=0, atol=0)


def _mapped_files(ptr: int) -> list[str]:
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= ptr < hi and len(fields) >= 6:
            found.append(fields[5])
    return found


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc/self/maps")
def test_matching_dtype_stays_memory_mapped() -> None:
    tensors = load_safetensors(STORIES, torch.float32, progress=False)
    emb = tensors["model.embed_tokens.weight"]
    assert str(STORIES / "model.safetensors") in _mapped_files(emb.data_ptr())
    converted = load_safetensors(STORIES, torch.bfloat16, progress=False)
    assert str(STORIES / "model.safetensors") not in _mapped_files(
        converted["model.embed_tokens.weight"].data_ptr()
    )


def test_integer_tensors_are_left_alone(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2, 2), "idx": torch.arange(4, dtype=torch.int64)},
              str(tmp_path / "model.safetensors"))
    tensors = load_safetensors(tmp_path, torch.float16, progress=True)
    assert tensors["w"].dtype == torch.float16
    assert tensors["idx"].dtype == torch.int64


def test_sharded_equals_single(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    _sharded_copy(STORIES, tmp_path / "sharded", reference)
    tensors = load_safetensors(tmp_path / "sharded", torch.float32, progress=False, max_workers=2)
    assert tensors.keys() == reference.keys()
    for name, tensor in tensors.items():
        assert torch.equal(tensor, reference[name]), name


def test_missing_shard(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    _sharded_copy(STORIES, tmp_path / "sharded", reference)
    (tmp_path / "sharded" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        load_safetensors(tmp_path / "sharded", torch.float32, progress=False)


def test_tensor_in_two_shards(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    weight_map = _sharded_copy(STORIES, tmp_path / "sharded", reference)
    name = "model.norm.weight"
    other = next(s for s in set(weight_map.values()) if s != weight_map[name])
    tensors = load_file(str(tmp_path / "sharded" / other))
    tensors[name] = reference[name]
    save_file(tensors, str(tmp_path / "sharded" / other))
    with pytest.raises(ModelLoadError, match="listed twice"):
        load_safetensors(tmp_path / "sharded", torch.float32, progress=False)


def test_tensor_listed_twice_in_index(tmp_path: Path, reference: dict[str, torch.Tensor]) -> None:
    _sharded_copy(STORIES, tmp_path / "sharded", reference)
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    text = index.read_text()
    dup = '"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors", '
    index.write_text(text.replace('"weight_map": {', dup, 1))
    with pytest.raises(ModelLoadError, match="listed twice"):
        load_safetensors(tmp_path / "sharded", torch.float32, progress=False)


def test_index_names_tensor_absent_from_shard(
    tmp_path: Path, reference: dict[str, torch.Tensor]
) -> None:
    _sharded_copy(STORIES, tmp_path / "sharded", reference)
    index = tmp_path / "sharded" / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="ghost.weight"):
        load_safetensors(tmp_path / "sharded", torch.float32, progress=False)


def test_pickle_checkpoint_refused(tmp_path: Path) -> None:
    shutil.copy(STORIES / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not even opened")
    with pytest.raises(ModelLoadError, match="pickle"):
        load_safetensors(tmp_path, torch.float32, progress=False)


def test_no_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no weights"):
        load_safetensors(tmp_path, torch.float32, progress=False)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_safetensors(tmp_path, torch.float32, progress=False)


def test_tokenizer_offline_and_eos_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(STORIES)
    ids = tokenizer.encode("Once upon a time")
    assert ids[0] == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Once upon a time"
    assert eos_token_ids(read_hf_config(STORIES), tokenizer) == frozenset({2})


def test_tokenizer_missing(tmp_path: Path) -> None:
    shutil.copy(STORIES / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no tokenizer"):
        load_tokenizer(tmp_path)


class _Tok:
    eos_token_id = 7


def test_eos_union_of_sources() -> None:
    config = {"eos_token_id": [2, 3], "_generation_config": {"eos_token_id": 4}}
    assert eos_token_ids(config, _Tok()) == frozenset({2, 3, 4, 7})
    assert eos_token_ids({"_generation_config": {"eos_token_id": [5, 6]}}, None) == {5, 6}
    assert eos_token_ids({}, object()) == frozenset()
    with pytest.raises(ModelLoadError, match="eos_token_id"):
        eos_token_ids({"eos_token_id": "2"}, None)
