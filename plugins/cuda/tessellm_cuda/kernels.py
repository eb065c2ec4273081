"""The kernel lists of the two devices: the Triton kernels (imported here, once the device is
known to be available, see triton_ops) and torch kernels for the other ops."""
from __future__ import annotations

from tessellm.plugin_api import Kernel
from tessellm_cuda.torch_ops import TORCH_ALTERNATIVES, TORCH_ONLY


def triton_kernel_list(device: str) -> list[Kernel]:
    from tessellm_cuda.triton_ops import (activations, attention, kv_cache, lora, moe, norms,
                                          packed_linear, rotary, sampling, token_bitmask)
    supports = getattr(attention, "supports", None)
    extra = {"supports": supports} if supports is not None else {}
    return [
        Kernel("attention_decode", "decode_triton_paged", attention.paged_attention_decode,
               device, description="Triton, paged, one program per (sequence, KV head)", **extra),
        Kernel("attention_prefill", "prefill_triton_paged", attention.paged_attention_prefill,
               device, description="Triton, varlen over the paged cache, causal", **extra),
        Kernel("write_kv_cache", "write_kv_triton", kv_cache.write_kv_cache, device,
               description="Triton, one program per token; slot -1 skipped"),
        Kernel("rms_norm", "rms_norm_triton", norms.rms_norm, device, description="Triton"),
        Kernel("fused_add_rms_norm", "fused_add_rms_norm_triton", norms.fused_add_rms_norm,
               device, description="Triton, add and norm in one pass"),
        Kernel("rotary_embedding", "rotary_triton", rotary.rotary_embedding, device,
               description="Triton, NeoX half-split"),
        Kernel("silu_and_mul", "silu_and_mul_triton", activations.silu_and_mul, device,
               description="Triton"),
        Kernel("sample_tokens", "sample_triton", sampling.sample_tokens, device,
               description="Triton, one program per row over vocab chunks; top-k / top-p "
                           "cut-offs by binary search on the float bits"),
        Kernel("linear_packed", "linear_packed_triton", packed_linear.linear_packed, device,
               supports=lambda q: packed_linear.supports_qtype(q.dim("qtype")),
               description="Triton, GGUF blocks and K-quant super-blocks dequantized in "
                           "registers; a GEMV up to 8 rows, tl.dot tiles past"),
        Kernel("fused_moe", "fused_moe_triton", moe.fused_moe, device,
               supports=lambda q: moe.supports_dtype(q.dtype),
               description="Triton, pairs sorted by expert into padded blocks on the device; "
                           "grouped GEMMs gate_up (+ silu * up) and down (x routing weight), "
                           "a float32 sum over each token's top_k"),
        Kernel("apply_token_bitmask", "token_bitmask_triton", token_bitmask.apply_token_bitmask,
               device, description="Triton, one program per (row, 1024 tokens), bits by "
                                   "shifts"),
        Kernel("lora_add", "lora_add_triton", lora.lora_add, device,
               description="Triton, shrink per (row, rank tile) then expand per (row, 128 "
                           "features); base-model rows read no weight"),
    ]


def _torch_kernels(device: str, table: dict) -> list[Kernel]:
    return [Kernel(op, name, fn, device, description=desc)
            for op, entries in table.items() for name, fn, desc in entries]


def cuda_kernels(device: str) -> list[Kernel]:
    """Triton kernels first (kernel_selection "first" takes them), torch alternatives after."""
    return (triton_kernel_list(device) + _torch_kernels(device, TORCH_ALTERNATIVES)
            + _torch_kernels(device, TORCH_ONLY))


def interpreter_kernels(device: str) -> list[Kernel]:
    """The Triton kernels and torch for the ops they do not cover: every op Triton covers is
    run by the interpreter, so an end-to-end run checks each of them."""
    return triton_kernel_list(device) + _torch_kernels(device, TORCH_ONLY)
