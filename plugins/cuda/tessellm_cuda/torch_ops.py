"""Kernels in torch for the ops this plugin has no Triton kernel for (GEMMs go to cuBLAS
through F.linear), and torch alternatives the profiler ranks against the Triton ones on a GPU:
tessellm's portable kernels (`plugin_api.portable`: device-agnostic, no host sync) and torch
built-ins."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessellm.plugin_api import portable, reference

# op -> [(kernel name, fn, description)] for every op without a Triton kernel
TORCH_ONLY = {
    "embedding": [("embedding_torch", F.embedding, "F.embedding")],
    "linear": [("linear_torch", F.linear, "F.linear (cuBLAS on a GPU)")],
    "linear_packed": [("linear_packed_dequant", portable.linear_packed_dequant,
                       "dequantize to the activation dtype, then F.linear")],
    "embedding_packed": [("embedding_packed_rows", portable.embedding_packed_rows,
                          "dequantized rows")],
    "layer_norm": [("layer_norm_torch", portable.layer_norm, "F.layer_norm")],
    "add": [("add_torch", torch.add, "")],
    "mul": [("mul_torch", torch.mul, "")],
    "silu": [("silu_torch", F.silu, "")],
    "gelu_tanh": [("gelu_tanh_torch", portable.gelu_tanh, "")],
    "moe_router": [("moe_router_torch", portable.moe_router, "softmax/sigmoid, topk")],
    "fused_moe_packed": [("fused_moe_packed_dense", portable.fused_moe_packed_dense,
                          "experts dequantized, then every expert on every token")],
    "sigmoid_gate": [("sigmoid_gate_torch", portable.sigmoid_gate, "")],
    "mul_scalar": [("mul_scalar_torch", portable.mul_scalar, "")],
    "logit_softcap": [("logit_softcap_torch", portable.logit_softcap, "")],
}

# torch alternatives to Triton kernels, ranked against them on a GPU (not offered by the
# interpreter device, whose purpose is to run the Triton kernels)
TORCH_ALTERNATIVES = {
    "rms_norm": [("rms_norm_torch", portable.rms_norm, "float32 math")],
    "fused_add_rms_norm": [("fused_add_rms_norm_torch", portable.fused_add_rms_norm, "")],
    "silu_and_mul": [("silu_and_mul_torch", portable.silu_and_mul, "")],
    "write_kv_cache": [("write_kv_cache_torch", portable.write_kv_cache,
                        "index_put; padding slots (-1) left unchanged")],
    "sample_tokens": [("sample_tokens_torch", reference.sample_tokens,
                       "the torch reference (sort, cumsum, softmax, argmax)")],
    "apply_token_bitmask": [("token_bitmask_torch", portable.apply_token_bitmask,
                             "bits by AND with 32 one-bit words, masked_fill_")],
    "fused_moe": [("fused_moe_dense", portable.fused_moe_dense,
                   "every expert on every token (no host sync: CUDA-graph safe)")],
    "lora_add": [("lora_add_dense_slots", portable.lora_add_dense_slots,
                  "every slot for every row, a one-hot mask (no host sync: CUDA-graph safe)")],
}
