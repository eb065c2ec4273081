"""The XLA device's kernels: tessellm's portable torch kernels (no host reads, shapes from
input shapes alone), one per op, so no op is profiled on a device where every example shape
would be a compilation. Attention is one static-shape kernel for decode and prefill alike
(the engine runs every padded step as prefills on this device)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessellm.plugin_api import Kernel, portable


def xla_kernels(device: str) -> list[Kernel]:
    def k(op: str, name: str, fn, description: str = "") -> Kernel:
        return Kernel(op=op, name=name, fn=fn, device=device, description=description)

    attention = "gathered paged attention, chunked online softmax, static shapes"
    return [
        k("embedding", "embedding_xla", F.embedding),
        k("linear", "linear_xla", F.linear),
        k("rms_norm", "rms_norm_xla", portable.rms_norm),
        k("fused_add_rms_norm", "fused_add_rms_norm_xla", portable.fused_add_rms_norm),
        k("layer_norm", "layer_norm_xla", portable.layer_norm),
        k("add", "add_xla", torch.add),
        k("mul", "mul_xla", torch.mul),
        k("silu", "silu_xla", F.silu),
        k("silu_and_mul", "silu_and_mul_xla", portable.silu_and_mul),
        k("gelu_tanh", "gelu_tanh_xla", portable.gelu_tanh),
        k("mul_scalar", "mul_scalar_xla", portable.mul_scalar),
        k("logit_softcap", "logit_softcap_xla", portable.logit_softcap),
        k("rotary_embedding", "rotary_xla", portable.rotary_embedding),
        k("write_kv_cache", "write_kv_xla", portable.write_kv_cache,
          "index_put; padding slots write back their own value"),
        k("attention_prefill", "attention_static_xla", portable.paged_attention_static, attention),
        k("attention_decode", "attention_static_xla", portable.paged_attention_static, attention),
        k("moe_router", "moe_router_xla", portable.moe_router),
        k("fused_moe", "fused_moe_dense_xla", portable.fused_moe_dense,
          "every expert on every token, weighted by the routing (static shapes)"),
        k("fused_moe_packed", "fused_moe_packed_dense_xla", portable.fused_moe_packed_dense,
          "experts dequantized, then as fused_moe_dense_xla"),
        k("sigmoid_gate", "sigmoid_gate_xla", portable.sigmoid_gate),
        k("apply_token_bitmask", "token_bitmask_xla", portable.apply_token_bitmask,
          "bits by AND with 32 one-bit words, masked_fill_ (static shapes)"),
        k("lora_add", "lora_add_dense_slots_xla", portable.lora_add_dense_slots,
          "every slot for every row, a one-hot mask (static shapes)"),
    ]
