"""The CPU plugin's kernels. Each has the reference op's signature; where two candidates exist
the profiler picks the faster correct one per token bucket. Plain-torch formulations that suit
every device come from tessellm's portable kernels (plugin_api.portable)."""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.nn.functional as F

from tessellm.plugin_api import Kernel, KernelQuery, WeightLayout, portable, reference
from tessellm_cpu import attention, lora, moe
from tessellm_cpu.native_build import NativeBuildError
from tessellm_cpu.native_team import TeamKernelC

log = logging.getLogger(__name__)


def rms_norm_aten(x, weight, eps):
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    summed = x + residual
    return rms_norm_aten(summed, weight, eps), summed


def silu_and_mul_inplace(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]).mul_(x[..., d:])


def write_kv_index_copy(k, v, kv_cache, slot_mapping):
    _, _, nkv, block_size, hd = kv_cache.shape
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:   # padding tokens: not written
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    index = (slot_mapping // block_size, slice(None), slot_mapping % block_size)
    kv_cache[0][index] = k.view(-1, nkv, hd).to(kv_cache.dtype)
    kv_cache[1][index] = v.view(-1, nkv, hd).to(kv_cache.dtype)


# oneDNN's prepacked linear: the weight reordered once into oneDNN's blocked layout (same
# size) instead of on every call: faster decode steps on the bench model (bf16), outputs equal
# to x @ w.t().
PREPACK_BATCH_HINT = 32


def _onednn_prepack_available() -> bool:
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise"))


def onednn_prepack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PREPACK_BATCH_HINT)


def linear_onednn_prepacked(x, weight, bias=None):
    x = x if x.is_contiguous() else x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_supports(query: KernelQuery) -> bool:
    if query.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return query.dtype == torch.float32


def onednn_kernels(device: str, not_offered: dict[str, str] | None = None) -> list[Kernel]:
    if not _onednn_prepack_available():
        why = "this torch has no oneDNN prepacked linear"
        log.warning("tessellm_cpu: %s; not offered", why)
        if not_offered is not None:
            not_offered["linear_onednn_prepacked"] = why
        return []
    return [Kernel("linear", "linear_onednn_prepacked", linear_onednn_prepacked, device,
                   supports=_onednn_supports, description="oneDNN, weight prepacked once",
                   weight_layout=WeightLayout("onednn_blocked", onednn_prepack))]


def native_kernels(device: str, not_offered: dict[str, str] | None = None,
                   recorder: Any = None) -> list[Kernel]:
    """The C kernels this machine can build and load. One that cannot (no compiler, an
    unusable cache directory, a timeout, a corrupt object, ...) is not offered: a warning
    says why, and so does `not_offered` (kernel name -> reason), which the CPU device reports
    to `tessellm plugins`. Nothing here stops the device or its other kernels."""
    from tessellm_cpu.native_attention import NativeDecode, NativePrefill
    from tessellm_cpu.native_linear_f32 import NativeLinearF32
    from tessellm_cpu.native_lora import NativeLoRAAdd
    from tessellm_cpu.native_moe import NativeMoEPacked, NativeMoEQ8Act, NativeMoeRouter
    from tessellm_cpu.native_linear import (NativePackedEmbedding, NativePackedLinear,
                                            NativeQ8ActLinear)
    from tessellm_cpu.native_token_ops import (NativeEmbedding, NativeFusedAddRmsNorm,
                                               NativeGreedy, NativeRmsNorm, NativeRotary,
                                               NativeSiluAndMul, NativeTokenBitmask,
                                               NativeWriteKV)
    specs = (("attention_decode", "decode_native_paged", NativeDecode, "C, in-place paged reads"),
             ("attention_prefill", "prefill_native_paged", NativePrefill,
              "C, in-place paged reads, each query token causal over its sequence"),
             ("linear_packed", "linear_packed_native", NativePackedLinear,
              "C, reads Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 blocks and Q4_K/Q5_K/Q6_K super-blocks in place"),
             ("linear_packed_q8act", "linear_q8act_vnni", NativeQ8ActLinear,
              "C, int8 dot products (AVX-512 VNNI), legacy blocks and K-quant super-blocks in place"),
             ("embedding_packed", "embedding_packed_native", NativePackedEmbedding,
              "C, the rows read dequantized to float32"),
             ("embedding", "embedding_native", NativeEmbedding, "C, ids checked, rows copied"),
             ("rotary_embedding", "rotary_native", NativeRotary, "C, one pass per token"),
             ("write_kv_cache", "write_kv_native", NativeWriteKV, "C, row copies; slot -1 skipped"),
             ("rms_norm", "rms_norm_native", NativeRmsNorm, "C, one pass per row"),
             ("fused_add_rms_norm", "fused_add_rms_norm_native", NativeFusedAddRmsNorm,
              "C, add and norm in one pass per row"),
             ("silu_and_mul", "silu_and_mul_native", NativeSiluAndMul,
              "C, one pass per row"),
             ("greedy_tokens", "greedy_native", NativeGreedy,
              "C, AVX-512 max then first index, rows over threads"),
             ("apply_token_bitmask", "token_bitmask_native", NativeTokenBitmask,
              "C, all-ones words skipped, AVX-512 masked stores of -inf"),
             ("linear", "linear_f32_native", NativeLinearF32,
              "C, float32, up to 16 rows: output features over the team, 16-lane dots"),
             ("moe_router", "moe_router_native", NativeMoeRouter,
              "C, softmax / sigmoid and top-k per token"),
             ("lora_add", "lora_add_native", NativeLoRAAdd,
              "C, every row's shrink then expand by output blocks, one team call"),
             ("fused_moe_packed", "fused_moe_packed_native", NativeMoEPacked,
              "C, pairs sorted by expert, each chosen expert's blocks read once in place, "
              "one team call per layer"),
             ("fused_moe_packed_q8act", "fused_moe_q8act_vnni", NativeMoEQ8Act,
              "C, as fused_moe_packed_native with int8 dot products (AVX-512 VNNI); each "
              "token's row quantized once for all its experts"))
    return _built_kernels(specs, device, not_offered, recorder)


def moe_packed_kernel(device: str, not_offered: dict[str, str] | None = None,
                      amx: bool = True) -> Kernel:
    """fused_moe_packed over the native packed linear (and the AMX one for many rows where
    `amx`: the CPU has it), or dequantize-then-GEMM per expert where the native linear cannot
    be built (named in `not_offered`)."""
    from tessellm_cpu.native_linear import NativePackedLinear
    try:
        linear = NativePackedLinear()
    except NativeBuildError as e:
        if not_offered is not None:
            not_offered["fused_moe_packed_grouped"] = str(e)
        fn = moe.FusedMoEPacked(None, None)
        return Kernel("fused_moe_packed", "fused_moe_packed_dequant", fn, device,
                      supports=fn.supports, description="dequantize each chosen expert, GEMM")
    many_rows = None   # without AMX the float linear serves every expert
    if amx:
        try:
            from tessellm_cpu.native_linear import NativePackedAmxLinear
            many_rows = NativePackedAmxLinear()
        except NativeBuildError:
            pass
    fn = moe.FusedMoEPacked(linear, NativePackedLinear.max_tokens, many_rows)
    return Kernel("fused_moe_packed", "fused_moe_packed_grouped", fn, device,
                  supports=fn.supports,
                  description="tokens sorted by expert in torch; each chosen expert's linears "
                              "by the native packed linears (AMX for 16+ rows where present; "
                              "dequantize-then-GEMM past 256 rows)")


def _amx_missing() -> list[str]:
    """The AMX flags this CPU lacks (its kernels are not even compiled where any is); all of
    them when TESSELLM_CPU_NO_AMX=1 asks the plugin to run as on a CPU without AMX (as
    oneDNN's ONEDNN_MAX_CPU_ISA caps its ISA)."""
    from tessellm_cpu.native_build import host_cpu_flags
    flags = set() if os.environ.get("TESSELLM_CPU_NO_AMX") == "1" else host_cpu_flags()
    return sorted({"amx_tile", "amx_bf16", "amx_int8"} - flags)


def amx_kernels(device: str, not_offered: dict[str, str] | None = None,
                missing: list[str] | None = None) -> list[Kernel]:
    """The AMX kernels where this machine has AMX: the bf16 linear (it reads its weight in a
    layout of its own, so it comes after the plain kernels, like oneDNN's) and the float and
    int8 linears over packed weights for many rows (after the row kernels, which
    kernel_selection "first" takes). `missing`: the AMX flags the CPU lacks (_amx_missing()
    when None); with any, none is built and each is named not offered, without a warning
    (expected on most CPUs)."""
    from tessellm_cpu.native_amx import NativeAmxLinear
    from tessellm_cpu.native_linear import NativePackedAmxLinear, NativeQ8ActAmxLinear
    specs = (("linear", "linear_amx_native", NativeAmxLinear,
              "C, AMX bf16 tiles, weight packed once"),
             ("linear_packed", "linear_packed_amx", NativePackedAmxLinear,
              "C, AMX bf16 tiles over levels decoded per call, x in three bf16 parts: "
              "float32-exact (16+ rows)"),
             ("linear_packed_q8act", "linear_q8act_amx", NativeQ8ActAmxLinear,
              "C, AMX int8 tiles over blocks decoded per call (16+ rows)"))
    missing = _amx_missing() if missing is None else missing
    if not missing:
        return _built_kernels(specs, device, not_offered)
    if not_offered is not None:
        why = f"this CPU has no AMX ({', '.join(missing)} not in its flags)"
        not_offered.update({name: why for _, name, _, _ in specs})
    return []


def bf16dot_kernels(device: str, not_offered: dict[str, str] | None = None,
                    recorder: Any = None) -> list[Kernel]:
    """The bfloat16 linear on AVX-512 BF16 dot products where the CPU has them (after the
    plain linears: it reads its weight in a layout of its own); named not offered, without a
    warning, on a CPU whose flags lack avx512_bf16."""
    from tessellm_cpu.native_bf16dot import NativeBf16DotLinear
    from tessellm_cpu.native_build import host_cpu_flags
    specs = (("linear", "linear_bf16dot_native", NativeBf16DotLinear,
              "C, AVX-512 BF16 dot products, weight packed once, next strip prefetched"),)
    if "avx512_bf16" in host_cpu_flags():
        return _built_kernels(specs, device, not_offered, recorder)
    if not_offered is not None:
        not_offered["linear_bf16dot_native"] = "this CPU has no AVX-512 BF16 (avx512_bf16)"
    return []


def _built_kernels(specs, device: str, not_offered: dict[str, str] | None,
                   recorder: Any = None) -> list[Kernel]:
    """A Kernel for each (op, name, build, description) whose build() succeeds; one that
    fails is named in `not_offered` with why, and a warning says so. The built object gives
    `supports`, and its `weight_layout` when it reads its weight in a form of its own; a
    team kernel gets the device's program recorder (tessellm_cpu.native_program)."""
    out = []
    for op, name, build, description in specs:
        try:
            fn = build()
        except NativeBuildError as e:
            why = str(e)
        except Exception as e:  # fail safe: an unforeseen failure loses this kernel only
            why = f"{type(e).__name__}: {e}"
        else:
            if isinstance(fn, TeamKernelC):
                fn.recorder = recorder
            out.append(Kernel(op=op, name=name, fn=fn, device=device, supports=fn.supports,
                              description=description,
                              weight_layout=getattr(fn, "weight_layout", None)))
            continue
        log.warning("tessellm_cpu: native kernel %s unavailable, not offered: %s", name, why)
        if not_offered is not None:
            not_offered[name] = why
    return out


def cpu_kernels(device: str, not_offered: dict[str, str] | None = None,
                recorder: Any = None) -> list[Kernel]:
    """Every CPU kernel this machine can run; those it cannot are named in `not_offered`
    (kernel name -> reason) when given. `recorder`: the device's ProgramRecorder, which the
    native kernels consult to become program nodes while a decode program is recorded."""
    def k(op: str, name: str, fn, description: str = "", supports=None) -> Kernel:
        extra = {} if supports is None else {"supports": supports}
        return Kernel(op=op, name=name, fn=fn, device=device, description=description,
                      **extra)

    from tessellm_cpu.native_build import prebuild
    from tessellm_cpu.native_linear import NATIVE
    # a fresh cache compiles them side by side (the AMX sources only where the CPU has AMX)
    amx_missing = _amx_missing()
    amx = not amx_missing
    prebuild(sorted(s for s in NATIVE.glob("*.c") if amx or "amx" not in s.stem.split("_")))
    # kernels with a weight layout come after the plain ones, so kernel_selection "first"
    # never converts a weight
    return native_kernels(device, not_offered, recorder) + [
        k("embedding", "embedding_aten", F.embedding),
        k("linear", "linear_aten", F.linear),
        k("linear_packed", "linear_packed_dequant_matmul", portable.linear_packed_dequant,
          "dequantize to the activation dtype, then F.linear"),
        k("linear_packed_q8act", "linear_packed_q8act_torch", reference.linear_packed_q8act,
          "input blocks rounded to int8, then a float32 matmul over the dequantized weight"),
        k("embedding_packed", "embedding_packed_rows", portable.embedding_packed_rows),
        k("rms_norm", "rms_norm_aten", rms_norm_aten, "F.rms_norm in float32"),
        k("rms_norm", "rms_norm_composite", portable.rms_norm, "pow/mean/rsqrt in float32"),
        k("fused_add_rms_norm", "fused_add_rms_norm_aten", fused_add_rms_norm),
        k("layer_norm", "layer_norm_aten", portable.layer_norm),
        k("add", "add_aten", torch.add),
        k("mul", "mul_aten", torch.mul),
        k("silu", "silu_aten", F.silu),
        k("silu_and_mul", "silu_and_mul_chunk", portable.silu_and_mul),
        k("silu_and_mul", "silu_and_mul_inplace", silu_and_mul_inplace),
        k("gelu_tanh", "gelu_tanh_aten", portable.gelu_tanh),
        k("mul_scalar", "mul_scalar_aten", portable.mul_scalar),
        k("logit_softcap", "logit_softcap_aten", portable.logit_softcap),
        k("rotary_embedding", "rotary_neox", portable.rotary_embedding),
        k("write_kv_cache", "write_kv_index_copy", write_kv_index_copy),
        k("attention_decode", "decode_batched_sdpa", attention.decode_batched_sdpa,
          supports=attention.no_softcap),
        k("attention_decode", "decode_batched_bmm", attention.decode_batched_bmm),
        k("attention_decode", "decode_per_seq_sdpa", attention.decode_per_seq_sdpa,
          supports=attention.no_softcap),
        k("attention_prefill", "prefill_per_seq_sdpa", attention.prefill_per_seq_sdpa,
          supports=attention.no_softcap),
        k("attention_prefill", "prefill_batched_sdpa", attention.prefill_batched_sdpa,
          supports=attention.no_softcap),
        k("attention_prefill", "prefill_per_seq_eager", attention.prefill_per_seq_eager,
          "float32 matmuls per sequence; takes logit_softcap"),
        k("greedy_tokens", "greedy_torch_max", reference.greedy_tokens, "torch.max(...).indices"),
        k("apply_token_bitmask", "token_bitmask_torch", reference.apply_token_bitmask,
          "bits by AND with 32 one-bit words, masked_fill_"),
        k("moe_router", "moe_router_torch", reference.moe_router, "softmax/sigmoid, topk"),
        k("fused_moe", "fused_moe_grouped", moe.fused_moe_grouped,
          "tokens sorted by expert, one GEMM pair per chosen expert"),
        moe_packed_kernel(device, not_offered, amx),
        k("fused_moe_packed_q8act", "fused_moe_packed_q8act_torch",
          reference.fused_moe_packed_q8act,
          "expert by expert: inputs rounded to int8 blocks, float32 matmuls over the "
          "dequantized experts"),
        k("sigmoid_gate", "sigmoid_gate_torch", reference.sigmoid_gate),
        k("lora_add", "lora_add_grouped", lora.lora_add_grouped,
          "rows gathered per adapter, one GEMM pair per adapter present"),
        k("lora_add", "lora_add_dense_slots", portable.lora_add_dense_slots,
          "every slot for every row, a one-hot mask per row"),
    ] + onednn_kernels(device, not_offered) + bf16dot_kernels(device, not_offered, recorder) \
        + amx_kernels(device, not_offered, amx_missing)
