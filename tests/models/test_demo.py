"""Tests for the built-in demo model (tessellm.models.demo)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tessellm.errors import ModelLoadError
from tessellm.models import demo
from tessellm.models.demo import DEMO_NOTICE, ensure_demo_model
from tessellm.models.hf_files import eos_token_ids, load_safetensors, read_hf_config
from tessellm.models.source_tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_demo_model(tmp_path_factory.mktemp("cache") / "demo-model")


@pytest.fixture(scope="module")
def tokenizer(demo_dir: Path):  # noqa: ANN201 - a transformers tokenizer
    return load_tokenizer(demo_dir)


def test_layout_and_config(demo_dir: Path) -> None:
    for name in demo.REQUIRED_FILES:
        assert (demo_dir / name).is_file(), name
    assert "untrained" in (demo_dir / "README.md").read_text(encoding="utf-8")
    assert "gibberish" in DEMO_NOTICE
    config = read_hf_config(demo_dir)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["num_hidden_layers"]) == (64, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["intermediate_size"] == 128
    assert config["tie_word_embeddings"] is False
    assert not list(demo_dir.parent.glob(".demo-model.tmp-*"))  # temp dir cleaned up


def test_weights_and_vocab(demo_dir: Path, tokenizer) -> None:  # noqa: ANN001
    tensors = load_safetensors(demo_dir, torch.float32, progress=False)
    assert len(tensors) == 2 + 9 * 2 + 1
    assert tensors["model.embed_tokens.weight"].shape == (len(tokenizer), 64)
    assert tensors["lm_head.weight"].shape == (len(tokenizer), 64)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert torch.equal(tensors["model.norm.weight"], torch.ones(64))
    std = tensors["model.layers.0.mlp.up_proj.weight"].std().item()
    assert 0.015 < std < 0.025


def test_deterministic_across_dirs(demo_dir: Path, tmp_path: Path) -> None:
    other = ensure_demo_model(tmp_path / "elsewhere")
    expected = (demo_dir / "model.safetensors").read_bytes()
    assert (other / "model.safetensors").read_bytes() == expected


def test_reused_when_complete(tmp_path: Path) -> None:
    first = ensure_demo_model(tmp_path / "m")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = ensure_demo_model(tmp_path / "m")
    assert again == first
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp


def test_empty_dir_is_filled(tmp_path: Path) -> None:
    assert ensure_demo_model(tmp_path) == tmp_path.absolute()
    assert (tmp_path / "model.safetensors").is_file()


def test_stale_demo_dir_is_replaced(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / demo.MARKER_FILE).write_text(json.dumps({"format_version": -1}))
    (target / "config.json").write_text("{}")
    ensure_demo_model(target)
    assert read_hf_config(target)["model_type"] == "llama"


def test_foreign_dir_is_never_touched(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(ModelLoadError, match="refusing"):
        ensure_demo_model(tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_default_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSELLM_CACHE_DIR", str(tmp_path))
    assert demo.default_demo_dir() == tmp_path / "demo-model"
    monkeypatch.delenv("TESSELLM_CACHE_DIR")
    assert demo.default_demo_dir() == Path.home() / ".cache" / "tessellm" / "demo-model"


def test_tokenizer_special_ids(demo_dir: Path, tokenizer) -> None:  # noqa: ANN001
    ids = tokenizer.encode("hi")
    assert ids == [tokenizer.bos_token_id, ord("h"), ord("i")]
    assert tokenizer.bos_token == "<s>" and tokenizer.eos_token == "</s>"
    assert eos_token_ids(read_hf_config(demo_dir), tokenizer) == frozenset({tokenizer.eos_token_id})


@settings(max_examples=60, deadline=None)
@given(text=st.text())
def test_tokenizer_round_trips_utf8(tokenizer, text: str) -> None:  # noqa: ANN001
    assume("<s>" not in text and "</s>" not in text)  # those spell the special tokens
    ids = tokenizer.encode(text)
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_transformers_loads_it(demo_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(demo_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info.get("mismatched_keys")
    tensors = load_safetensors(demo_dir, torch.float32, progress=False)
    state = model.state_dict()
    assert torch.equal(state["lm_head.weight"], tensors["lm_head.weight"])
    assert torch.equal(state["model.layers.1.mlp.down_proj.weight"],
                      tensors["model.layers.1.mlp.down_proj.weight"])
