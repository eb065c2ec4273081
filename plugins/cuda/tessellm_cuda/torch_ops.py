"""Kernels written in torch for the ops this plugin has no Triton kernel for (GEMMs go to
cuBLAS through F.linear), and torch alternatives the profiler ranks against the Triton ones on
a GPU. All are device-agnostic torch; none synchronizes with the host."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessellm.plugin_api import PackedWeight, dequantize, reference


def linear_packed_dequant(x, weight: PackedWeight, bias=None):
    return F.linear(x, dequantize(weight, x.dtype), bias)


def embedding_packed_rows(ids, weight: PackedWeight):
    return dequantize(weight.rows(ids))


def layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def rms_norm_torch(x, weight, eps):
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def fused_add_rms_norm_torch(x, residual, weight, eps):
    summed = x + residual
    return rms_norm_torch(summed, weight, eps), summed


def silu_and_mul_torch(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def write_kv_cache_torch(k, v, kv_cache, slot_mapping):
    """index_put over the slots; padding slots (< 0) are redirected to a row that is written
    with its own old value, so nothing changes there and no host sync is needed."""
    _, _, nkv, block_size, hd = kv_cache.shape
    valid = slot_mapping >= 0
    slots = torch.where(valid, slot_mapping, 0)
    blocks, rows = slots // block_size, slots % block_size
    for i, src in enumerate((k, v)):
        new = src.view(-1, nkv, hd).to(kv_cache.dtype)
        old = kv_cache[i][blocks, :, rows]
        kv_cache[i][blocks, :, rows] = torch.where(valid[:, None, None], new, old)


# op -> [(kernel name, fn, description)] for every op without a Triton kernel
TORCH_ONLY = {
    "embedding": [("embedding_torch", F.embedding, "F.embedding")],
    "linear": [("linear_torch", F.linear, "F.linear (cuBLAS on a GPU)")],
    "linear_packed": [("linear_packed_dequant", linear_packed_dequant,
                       "dequantize to the activation dtype, then F.linear")],
    "embedding_packed": [("embedding_packed_rows", embedding_packed_rows, "dequantized rows")],
    "layer_norm": [("layer_norm_torch", layer_norm, "F.layer_norm")],
    "add": [("add_torch", torch.add, "")],
    "mul": [("mul_torch", torch.mul, "")],
    "silu": [("silu_torch", F.silu, "")],
    "gelu_tanh": [("gelu_tanh_torch", gelu_tanh, "")],
}

# torch alternatives to Triton kernels, ranked against them on a GPU (not offered by the
# interpreter device, whose purpose is to run the Triton kernels)
TORCH_ALTERNATIVES = {
    "rms_norm": [("rms_norm_torch", rms_norm_torch, "F.rms_norm in float32")],
    "fused_add_rms_norm": [("fused_add_rms_norm_torch", fused_add_rms_norm_torch, "")],
    "silu_and_mul": [("silu_and_mul_torch", silu_and_mul_torch, "")],
    "write_kv_cache": [("write_kv_cache_torch", write_kv_cache_torch,
                        "index_put; padding slots (-1) left unchanged")],
    "sample_tokens": [("sample_tokens_torch", reference.sample_tokens,
                       "the torch reference (sort, cumsum, softmax, argmax)")],
}
