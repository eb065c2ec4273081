"""Graph of the Llama family (Llama, Mistral, Qwen2, Qwen3), built unfused.

Per layer: h = x + o_proj(attn(rope(q, k), v)) with q/k/v from rms_norm(x); then
h + down(silu(gate(n)) * up(n)) with n = rms_norm(h). Qwen3 adds per-head rms_norm of q and k
before rope. The MoE families replace the MLP of their expert layers (tessellm.models.moe).
Fusion passes rewrite this graph later; the builder never fuses.
Weight names are the HF names; a tied lm_head reads the embedding weight.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tessellm.graph import ops
from tessellm.graph.ir import GraphBuilder, ModelGraph
from tessellm.models.moe import expert_mlp
from tessellm.models.spec import ModelSpec

COS_SIN = "rope.cos_sin"


def adapt_llama_weights(weights: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Drop what the graph does not read (rotary buffers of old checkpoints); add the rope table."""
    out = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    out[COS_SIN] = spec.rope_cos_sin()
    return out


def dense_mlp(b: GraphBuilder, n: fx.Node, spec: ModelSpec, layer: int, prefix: str,
              intermediate: int, role_prefix: str = "") -> fx.Node:
    """down(silu(gate(n)) * up(n)) over the weights `{prefix}.{gate,up,down}_proj`; roles
    `{role_prefix}gate_proj` etc. (tensor parallelism splits by them)."""
    gate = b.linear(n, f"{prefix}.gate_proj", role=f"{role_prefix}gate_proj", layer=layer,
                    bias=spec.mlp_bias)
    up = b.linear(n, f"{prefix}.up_proj", role=f"{role_prefix}up_proj", layer=layer,
                  bias=spec.mlp_bias)
    inter = {"features": intermediate}
    act = b.op(ops.mul, b.op(ops.silu, gate, dims=inter, role="act", layer=layer), up,
               dims=inter, role="act_mul", layer=layer)
    return b.linear(act, f"{prefix}.down_proj", role=f"{role_prefix}down_proj", layer=layer,
                    bias=spec.mlp_bias)


def build_llama_graph(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> ModelGraph:
    b = GraphBuilder(weights)
    inp = b.step_inputs(spec.num_layers, spec.kv_layout.layer_groups)
    h = spec.hidden_size
    norm = {"hidden": h}
    cos_sin = b.weight(COS_SIN)

    x = b.embedding(inp.input_ids, "model.embed_tokens.weight", role="embed")
    for i in range(spec.num_layers):
        p = f"model.layers.{i}"
        n = b.op(ops.rms_norm, x, b.weight(f"{p}.input_layernorm.weight"), spec.norm_eps,
                 dims=norm, role="input_norm", layer=i)
        q = b.linear(n, f"{p}.self_attn.q_proj", role="q_proj", layer=i, bias=spec.qkv_bias)
        k = b.linear(n, f"{p}.self_attn.k_proj", role="k_proj", layer=i, bias=spec.qkv_bias)
        v = b.linear(n, f"{p}.self_attn.v_proj", role="v_proj", layer=i, bias=spec.qkv_bias)
        if spec.qk_norm:
            q, k = (b.call(ops.merge_heads, b.op(
                ops.rms_norm, b.call(ops.per_head, t, spec.head_dim),
                b.weight(f"{p}.self_attn.{name}.weight"), spec.norm_eps,
                dims={"hidden": spec.head_dim, "heads": heads}, role=name, layer=i))
                for t, name, heads in ((q, "q_norm", spec.num_heads),
                                       (k, "k_norm", spec.num_kv_heads)))
        qk = b.op(ops.rotary_embedding, inp.positions, q, k, cos_sin, spec.head_dim,
                  dims=spec.attention_dims, role="rope", layer=i)
        attn_dims, attn_extra = spec.layer_attention(i)   # a sliding window, if any
        attn = b.op(ops.attention, b.item(qk, 0), b.item(qk, 1), v, inp.kv_caches[i],
                    inp.meta_of(i), spec.attention_scale, *attn_extra, dims=attn_dims,
                    role="attention", layer=i)
        o = b.linear(attn, f"{p}.self_attn.o_proj", role="o_proj", layer=i, bias=spec.o_bias)
        x = b.op(ops.add, o, x, dims=norm, role="attn_residual", layer=i)
        n = b.op(ops.rms_norm, x, b.weight(f"{p}.post_attention_layernorm.weight"),
                 spec.norm_eps, dims=norm, role="post_attention_norm", layer=i)
        if spec.moe is not None and spec.moe.is_expert_layer(i):
            mlp = expert_mlp(b, n, spec, i)
        else:
            mlp = dense_mlp(b, n, spec, i, f"{p}.mlp", spec.intermediate_size)
        x = b.op(ops.add, mlp, x, dims=norm, role="mlp_residual", layer=i)
    x = b.op(ops.rms_norm, x, b.weight("model.norm.weight"), spec.norm_eps, dims=norm,
             role="final_norm")
    last = b.call(ops.select_rows, x, inp.logits_indices)
    head = "model.embed_tokens" if spec.tie_word_embeddings or "lm_head.weight" not in weights \
        else "lm_head"
    b.output(b.linear(last, head, role="lm_head", layer=None, bias=False))
    return ModelGraph(b.graph, weights, spec.num_layers)
