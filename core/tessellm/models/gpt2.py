"""Graph of GPT-2: learned positions, pre-LayerNorm blocks, gelu_new MLP, tied LM head.

The HF checkpoint stores Conv1D weights as [in, out] and one fused c_attn; the adapter
transposes them to [out, in] and splits c_attn into q/k/v, so the graph is built unfused like
every other family and the qkv pass fuses it again where the device has the kernel.
"""
from __future__ import annotations

import torch

from tessellm.errors import ModelLoadError
from tessellm.graph import ops
from tessellm.graph.ir import GraphBuilder, ModelGraph
from tessellm.models.spec import ModelSpec

CONV1D = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def adapt_gpt2_weights(weights: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    w = {k.removeprefix("transformer."): v for k, v in weights.items()
         if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    out: dict[str, torch.Tensor] = {}
    for name, t in w.items():
        if any(name.endswith(f"{c}.weight") for c in CONV1D):
            t = t.t().contiguous()
        out[name] = t
    for i in range(spec.num_layers):
        p = f"h.{i}.attn"
        try:
            qkv_w, qkv_b = out.pop(f"{p}.c_attn.weight"), out.pop(f"{p}.c_attn.bias")
        except KeyError as e:
            raise ModelLoadError(f"GPT-2 checkpoint lacks {e.args[0]}") from None
        for name, wt, bt in zip("qkv", qkv_w.chunk(3, 0), qkv_b.chunk(3, 0)):
            out[f"{p}.{name}_proj.weight"], out[f"{p}.{name}_proj.bias"] = wt, bt
    return out


def build_gpt2_graph(spec: ModelSpec, weights: dict[str, torch.Tensor]) -> ModelGraph:
    b = GraphBuilder(weights)
    inp = b.step_inputs(spec.num_layers)
    h = spec.hidden_size
    hid = {"hidden": h}
    tok = b.embedding(inp.input_ids, "wte.weight", role="embed")
    pos = b.embedding(inp.positions, "wpe.weight", role="pos_embed")
    x = b.op(ops.add, tok, pos, dims=hid, role="embed_sum")
    for i in range(spec.num_layers):
        p = f"h.{i}"
        n = b.op(ops.layer_norm, x, b.weight(f"{p}.ln_1.weight"), b.weight(f"{p}.ln_1.bias"),
                 spec.norm_eps, dims=hid, role="input_norm", layer=i)
        q = b.linear(n, f"{p}.attn.q_proj", role="q_proj", layer=i, bias=True)
        k = b.linear(n, f"{p}.attn.k_proj", role="k_proj", layer=i, bias=True)
        v = b.linear(n, f"{p}.attn.v_proj", role="v_proj", layer=i, bias=True)
        attn = b.op(ops.attention, q, k, v, inp.kv_caches[i], inp.attn_meta,
                    spec.attention_scale, dims=spec.attention_dims, role="attention", layer=i)
        o = b.linear(attn, f"{p}.attn.c_proj", role="o_proj", layer=i, bias=True)
        x = b.op(ops.add, o, x, dims=hid, role="attn_residual", layer=i)
        n = b.op(ops.layer_norm, x, b.weight(f"{p}.ln_2.weight"), b.weight(f"{p}.ln_2.bias"),
                 spec.norm_eps, dims=hid, role="post_attention_norm", layer=i)
        fc = b.linear(n, f"{p}.mlp.c_fc", role="fc", layer=i, bias=True)
        act = b.op(ops.gelu_tanh, fc, dims={"features": spec.intermediate_size}, role="act",
                   layer=i)
        down = b.linear(act, f"{p}.mlp.c_proj", role="down_proj", layer=i, bias=True)
        x = b.op(ops.add, down, x, dims=hid, role="mlp_residual", layer=i)
    x = b.op(ops.layer_norm, x, b.weight("ln_f.weight"), b.weight("ln_f.bias"), spec.norm_eps,
             dims=hid, role="final_norm")
    last = b.call(ops.select_rows, x, inp.logits_indices)
    b.output(b.linear(last, "wte", role="lm_head", layer=None, bias=False))
    return ModelGraph(b.graph, weights, spec.num_layers)
