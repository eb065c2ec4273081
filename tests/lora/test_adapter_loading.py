"""Reading PEFT adapters (tessellm.lora.adapter) and LoRARequest: what is accepted, how it is
scaled, and a clear LoRAError for every adapter that cannot be used."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tessellm.errors import InvalidRequestError
from tessellm.lora.adapter import LoRAError, load_adapter
from tessellm.lora.request import LoRARequest

SHAPES = {(0, "q_proj"): (64, 64), (0, "v_proj"): (64, 32), (1, "down_proj"): (128, 64)}
PREFIX = "base_model.model.model.layers"


def _write(path: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
            "bias": "none"}
    base.update(config)
    (path / "adapter_config.json").write_text(json.dumps(base))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def _pair(layer: int, where: str, module: str, r: int, i: int, o: int) -> dict:
    g = torch.Generator().manual_seed(layer * 7 + r)
    return {f"{PREFIX}.{layer}.{where}.{module}.lora_A.weight": torch.randn((r, i), generator=g),
            f"{PREFIX}.{layer}.{where}.{module}.lora_B.weight": torch.randn((o, r), generator=g)}


def _load(path: Path, max_rank: int = 16):
    return load_adapter(LoRARequest("a", 1, str(path)), SHAPES, max_rank)


def test_reads_pairs_and_scales_b(tmp_path: Path) -> None:
    tensors = {**_pair(0, "self_attn", "q_proj", 4, 64, 64),
               **_pair(1, "mlp", "down_proj", 4, 128, 64)}
    adapter = _load(_write(tmp_path / "a", tensors, lora_alpha=12))
    assert adapter.rank == 4 and adapter.scaling == 3.0
    a, b = adapter.weights[(0, "q_proj")]
    torch.testing.assert_close(a, tensors[f"{PREFIX}.0.self_attn.q_proj.lora_A.weight"])
    torch.testing.assert_close(b, tensors[f"{PREFIX}.0.self_attn.q_proj.lora_B.weight"] * 3.0)
    assert set(adapter.weights) == {(0, "q_proj"), (1, "down_proj")}


def test_rslora_scales_by_the_square_root(tmp_path: Path) -> None:
    adapter = _load(_write(tmp_path / "a", _pair(0, "self_attn", "q_proj", 4, 64, 64),
                           lora_alpha=8, use_rslora=True))
    assert adapter.scaling == pytest.approx(8 / math.sqrt(4))


@pytest.mark.parametrize("tensors, config, message", [
    (lambda: _pair(0, "self_attn", "q_proj", 32, 64, 64), {"r": 32}, "exceeds max_lora_rank"),
    (lambda: _pair(0, "self_attn", "k_proj", 4, 64, 32), {}, "'k_proj' of layer 0 is not in"),
    (lambda: _pair(5, "self_attn", "q_proj", 4, 64, 64), {}, "of layer 5 is not in"),
    (lambda: _pair(0, "self_attn", "q_proj", 4, 48, 64), {}, "do not fit the base linear"),
    (lambda: {k: v for k, v in _pair(0, "self_attn", "q_proj", 4, 64, 64).items()
              if "lora_A" in k}, {}, "without its pair"),
    (lambda: {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}, {},
     "is not a lora_A / lora_B weight"),
    (lambda: _pair(0, "self_attn", "q_proj", 4, 64, 64), {"use_dora": True}, "DoRA"),
    (lambda: _pair(0, "self_attn", "q_proj", 4, 64, 64), {"modules_to_save": ["lm_head"]},
     "modules_to_save"),
    (lambda: _pair(0, "self_attn", "q_proj", 4, 64, 64), {"rank_pattern": {"q_proj": 8}},
     "rank_pattern"),
    (lambda: _pair(0, "self_attn", "q_proj", 4, 64, 64), {"bias": "all"}, "bias='all'"),
    (lambda: _pair(0, "self_attn", "q_proj", 4, 64, 64), {"peft_type": "IA3"}, "not LORA"),
    (lambda: _pair(0, "self_attn", "q_proj", 4, 64, 64), {"r": "4"}, "positive 'r'"),
    (lambda: _pair(0, "self_attn", "q_proj", 4, 64, 64), {"lora_alpha": -1}, "'lora_alpha'"),
    (lambda: _pair(0, "self_attn", "q_proj", 4, 64, 64), {"lora_alpha": True}, "'lora_alpha'"),
    (lambda: {}, {}, "holds no LoRA weights"),
])
def test_unusable_adapters_are_refused_by_name(tmp_path: Path, tensors, config,
                                               message: str) -> None:
    with pytest.raises(LoRAError, match="adapter 'a'") as e:
        _load(_write(tmp_path / "a", tensors(), **config))
    assert message in str(e.value)


def test_missing_and_corrupt_files(tmp_path: Path) -> None:
    with pytest.raises(LoRAError, match="does not exist"):
        _load(tmp_path / "nowhere")
    path = _write(tmp_path / "a", _pair(0, "self_attn", "q_proj", 4, 64, 64))
    (path / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{bad")
    with pytest.raises(LoRAError, match="not a readable safetensors"):
        _load(path)
    (path / "adapter_model.safetensors").unlink()
    (path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(LoRAError, match="adapter_model.bin is not read"):
        _load(path)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAError, match="cannot read adapter_config.json"):
        _load(path)
    (path / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(LoRAError, match="not a JSON object"):
        _load(path)
    (path / "adapter_config.json").unlink()
    with pytest.raises(LoRAError, match="adapter_config.json not found"):
        _load(path)


@pytest.mark.parametrize("args, message", [
    (("", 1, "p"), "lora_name"), ((None, 1, "p"), "lora_name"), (("a", 0, "p"), "lora_int_id"),
    (("a", True, "p"), "lora_int_id"), (("a", "1", "p"), "lora_int_id"),
    (("a", -3, "p"), "lora_int_id"), (("a", 1, ""), "lora_path"), (("a", 1, ["p"]), "lora_path"),
])
def test_lora_request_validates(args, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        LoRARequest(*args)
