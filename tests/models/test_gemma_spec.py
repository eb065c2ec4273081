"""Reading Gemma 2 / Gemma 3 configs and the sliding-window layers of every family
(tessellm.models.gemma, tessellm.models.spec.sliding_window_layers), as transformers 5 reads
them; the graph's parity with transformers is tests/models/test_hf_parity.py."""
from __future__ import annotations

import pytest
import torch

from tessellm.errors import UnsupportedModelError
from tessellm.graph import ops
from tessellm.models.architectures import resolve_architecture
from tessellm.models.gemma import adapt_gemma_weights, build_gemma_graph, gemma_spec
from tessellm.models.spec import llama_family_spec


def _gemma(arch: str, **extra) -> dict:
    return {"architectures": [arch], "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 7, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 256,
            "sliding_window": 16, **extra}


def test_gemma2_defaults_are_transformers_defaults() -> None:
    """No layer_types: every other layer slides, from layer 0; the soft-caps and the query
    scalar absent from config.json take Gemma2Config's defaults (50, 30, 256)."""
    spec = gemma_spec(_gemma("Gemma2ForCausalLM"))
    assert spec.sliding_layers == (0, 2, 4, 6) and spec.sliding_window == 16
    assert (spec.attn_logit_softcap, spec.final_logit_softcap) == (50.0, 30.0)
    assert spec.attention_scale == 256 ** -0.5
    assert spec.tie_word_embeddings and not spec.qk_norm
    dims, extra = spec.layer_attention(0)
    assert extra == (16, 50.0) and dims["sliding_window"] == 16
    assert dims["logit_softcap"] == 50000
    full_dims, full_extra = spec.layer_attention(1)
    assert full_extra == (0, 50.0) and "sliding_window" not in full_dims
    off = gemma_spec(_gemma("Gemma2ForCausalLM", attn_logit_softcapping=None,
                            final_logit_softcapping=None))
    assert off.attn_logit_softcap == off.final_logit_softcap == 0.0
    assert off.layer_attention(1) == (off.attention_dims, ())


def test_gemma3_pattern_rope_and_multimodal_text_config() -> None:
    """Five of six layers slide (sliding_window_pattern 6); full layers take rope_theta with
    its scaling, sliding ones rope_local_base_freq unscaled; a ConditionalGeneration config
    is read from its text_config."""
    cfg = _gemma("Gemma3ForCausalLM", rope_theta=1e6, rope_local_base_freq=1e4,
                 rope_scaling={"rope_type": "linear", "factor": 8.0})
    spec = gemma_spec(cfg)
    assert spec.sliding_layers == (0, 1, 2, 3, 4, 6) and spec.qk_norm and spec.gemma3
    assert spec.rope_theta == 1e6 and dict(spec.rope_scaling)["factor"] == 8.0
    assert spec.local_rope_theta == 1e4 and spec.local_rope_scaling == ()
    assert spec.attn_logit_softcap == spec.final_logit_softcap == 0.0
    multi = {"architectures": ["Gemma3ForConditionalGeneration"],
             "text_config": {k: v for k, v in cfg.items() if k != "architectures"},
             "vision_config": {"hidden_size": 8}}
    assert gemma_spec(multi) == spec
    assert resolve_architecture(multi).spec is gemma_spec


def test_gemma_weights_norms_and_multimodal_names() -> None:
    """Norm weights become 1 + w; a multimodal checkpoint's text weights get the causal-LM
    names and its vision weights are dropped; the graph reads the local rope table on
    sliding layers only."""
    spec = gemma_spec(_gemma("Gemma3ForCausalLM", num_hidden_layers=2,
                             sliding_window_pattern=2))
    w = torch.tensor([0.25, -0.5], dtype=torch.bfloat16)
    out = adapt_gemma_weights({"language_model.model.layers.0.input_layernorm.weight": w,
                               "model.language_model.layers.0.self_attn.q_norm.weight": w,
                               "language_model.model.norm.weight": w,
                               "language_model.model.embed_tokens.weight": w,
                               "vision_tower.vision_model.x.weight": w,
                               "multi_modal_projector.mm_input_projection_weight": w}, spec)
    assert out["model.layers.0.input_layernorm.weight"].tolist() == [1.25, 0.5]
    assert out["model.layers.0.self_attn.q_norm.weight"].tolist() == [1.25, 0.5]
    assert out["model.norm.weight"].dtype == torch.bfloat16
    assert out["model.embed_tokens.weight"] is w
    assert not any("vision" in k or "projector" in k for k in out)
    assert {"rope.cos_sin", "rope.cos_sin.local"} <= set(out)


def test_gemma_refuses_what_it_does_not_run() -> None:
    with pytest.raises(UnsupportedModelError, match="hidden_activation"):
        gemma_spec(_gemma("Gemma2ForCausalLM", hidden_activation="gelu"))
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        gemma_spec(_gemma("Gemma3ForCausalLM", use_bidirectional_attention=True))
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        gemma_spec(_gemma("Gemma2ForCausalLM", layer_types=["sliding_attention"] * 3))
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        gemma_spec(_gemma("Gemma2ForCausalLM", layer_types=["chunked_attention"] * 7))


def _llama_like(arch: str, **extra) -> dict:
    return {"architectures": [arch], "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
            "max_position_embeddings": 256, **extra}


def test_sliding_window_layers_of_the_llama_family() -> None:
    """Mistral: every layer, and the context is no longer capped at the window; a window
    that covers the context is dropped; Qwen2: use_sliding_window, from max_window_layers
    on; explicit layer_types win."""
    mistral = llama_family_spec(_llama_like("MistralForCausalLM", sliding_window=32))
    assert mistral.max_position_embeddings == 256
    assert (mistral.sliding_window, mistral.sliding_layers) == (32, (0, 1, 2, 3))
    assert mistral.all_layers_windowed
    wide = llama_family_spec(_llama_like("MistralForCausalLM", sliding_window=4096))
    assert (wide.sliding_window, wide.sliding_layers) == (0, ())
    qwen = llama_family_spec(_llama_like("Qwen2ForCausalLM", sliding_window=32,
                                         use_sliding_window=True, max_window_layers=2))
    assert qwen.sliding_layers == (2, 3) and not qwen.all_layers_windowed
    unused = llama_family_spec(_llama_like("Qwen2ForCausalLM", sliding_window=32))
    assert unused.sliding_layers == ()
    typed = llama_family_spec(_llama_like(
        "Qwen3ForCausalLM", sliding_window=32,
        layer_types=["full_attention", "sliding_attention"] * 2))
    assert typed.sliding_layers == (1, 3)
    llama = llama_family_spec(_llama_like("LlamaForCausalLM", sliding_window=32))
    assert llama.sliding_layers == ()


def test_gemma_graph_has_the_gemma_ops() -> None:
    spec = gemma_spec(_gemma("Gemma2ForCausalLM", num_hidden_layers=2))
    h, f, v, hd = 32, 64, 100, 16
    g = torch.Generator().manual_seed(0)
    weights = {"model.embed_tokens.weight": torch.randn(v, h, generator=g),
               "model.norm.weight": torch.zeros(h)}
    for i in range(2):
        p = f"model.layers.{i}"
        for n in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                  "post_feedforward_layernorm"):
            weights[f"{p}.{n}.weight"] = torch.zeros(h)
        for n, shape in (("self_attn.q_proj", (2 * hd, h)), ("self_attn.k_proj", (hd, h)),
                         ("self_attn.v_proj", (hd, h)), ("self_attn.o_proj", (h, 2 * hd)),
                         ("mlp.gate_proj", (f, h)), ("mlp.up_proj", (f, h)),
                         ("mlp.down_proj", (h, f))):
            weights[f"{p}.{n}.weight"] = torch.randn(shape, generator=g)
    mg = build_gemma_graph(spec, adapt_gemma_weights(weights, spec))
    assert mg.count(ops.mul_scalar) == 1 and mg.count(ops.logit_softcap) == 1
    assert mg.count(ops.rms_norm) == 9 and mg.count(ops.gelu_tanh) == 2
    attn = mg.op_nodes(ops.attention)
    assert [n.args[6:] for n in attn] == [(16, 50.0), (0, 50.0)]
