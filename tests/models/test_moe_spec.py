"""Mixture-of-experts configs and checkpoints (tessellm.models.moe): what is read, what is
refused with a clear error (no model is run here; tests/models/test_hf_parity.py runs them)."""
from __future__ import annotations

import pytest
import torch

from tessellm.errors import ModelLoadError, UnsupportedModelError
from tessellm.models.moe import adapt_moe_weights, moe_spec

BASE = dict(vocab_size=64, hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, intermediate_size=24, rms_norm_eps=1e-6,
            max_position_embeddings=64)


def qwen3_moe(**overrides):
    return {**BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 8, "norm_topk_prob": True,
            **overrides}


def test_qwen_layers_follow_sparse_step_and_mlp_only_layers() -> None:
    spec = moe_spec(qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert spec.moe.layers == (1,)            # (i + 1) % 2 == 0, minus layer 3
    assert spec.qk_norm and spec.moe.renormalize and spec.moe.expert_intermediate_size == 8
    assert moe_spec(qwen3_moe()).moe.layers == (0, 1, 2, 3)


def test_transformers_5_expert_count_key_and_mixtral_defaults() -> None:
    config = qwen3_moe()
    config["num_local_experts"] = config.pop("num_experts")   # how transformers 5 saves it
    assert moe_spec(config).moe.num_experts == 4
    mixtral = moe_spec({**BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                        "num_experts_per_tok": 2})
    assert mixtral.moe.renormalize and mixtral.moe.expert_intermediate_size == 24
    assert mixtral.moe.layers == (0, 1, 2, 3) and not mixtral.qkv_bias
    qwen2 = moe_spec({**qwen3_moe(), "architectures": ["Qwen2MoeForCausalLM"],
                      "shared_expert_intermediate_size": 12, "norm_topk_prob": False})
    assert qwen2.qkv_bias and not qwen2.moe.renormalize
    assert qwen2.moe.shared_expert_intermediate_size == 12


@pytest.mark.parametrize("overrides, match", [
    ({"num_experts_per_tok": 5}, "exceeds the 4 experts"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok must be a positive integer"),
    ({"num_experts": None}, "num_experts must be a positive integer"),
    ({"num_experts": "4"}, "num_experts must be a positive integer"),
    ({"moe_intermediate_size": True}, "moe_intermediate_size must be a positive integer"),
])
def test_bad_expert_settings_are_refused(overrides, match) -> None:
    with pytest.raises(UnsupportedModelError, match=match):
        moe_spec(qwen3_moe(**overrides))


def _expert_weights(spec, layers=(0, 1, 2, 3), experts=4, inter=8, hidden=16):
    w = {}
    for i in layers:
        for e in range(experts):
            for name, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                w[f"model.layers.{i}.mlp.experts.{e}.{name}.weight"] = torch.randn(shape)
    return w


def test_per_expert_tensors_are_stacked_gate_then_up() -> None:
    spec = moe_spec(qwen3_moe())
    w = _expert_weights(spec)
    g1 = w["model.layers.2.mlp.experts.1.gate_proj.weight"]
    u1 = w["model.layers.2.mlp.experts.1.up_proj.weight"]
    d3 = w["model.layers.2.mlp.experts.3.down_proj.weight"]
    out = adapt_moe_weights(dict(w), spec)
    w13 = out["model.layers.2.mlp.experts.gate_up_proj"]
    assert w13.shape == (4 * 16, 16)
    assert torch.equal(w13[16:24], g1) and torch.equal(w13[24:32], u1)
    assert torch.equal(out["model.layers.2.mlp.experts.down_proj"][48:64], d3)
    assert not any(".experts.0." in n for n in out)


def test_a_missing_expert_or_a_wrong_shape_is_a_load_error() -> None:
    spec = moe_spec(qwen3_moe())
    w = _expert_weights(spec)
    del w["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ModelLoadError, match="experts.3.up_proj"):
        adapt_moe_weights(w, spec)
    w = _expert_weights(spec, inter=6)
    with pytest.raises(ModelLoadError, match="4 experts of 8 features"):
        adapt_moe_weights(w, spec)
