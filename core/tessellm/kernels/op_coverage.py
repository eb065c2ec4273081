"""Which ops a device plugin must cover and which it may.

REQUIRED_OPS: the unfused ops of the built-in architectures' graphs; a device without one of
them cannot run some model (lowering names the op). OPTIONAL_OPS: the fusion targets (the
passes fuse only where the device has the fused op), the packed-weight ops (without them a
GGUF file's tensors are dequantized at load and `quantization` / `packed_activations` are
refused), the sampler's kernels (the reference op runs otherwise) and `lora_add` (without it
enable_lora is refused). Together they are every
op with a reference (kernels.reference.REFERENCE_OPS; a test keeps them so).
"""
from __future__ import annotations

REQUIRED_OPS = frozenset({
    "embedding", "linear", "rms_norm", "layer_norm", "add", "mul", "silu", "gelu_tanh",
    "rotary_embedding", "write_kv_cache", "attention_prefill", "attention_decode",
    "mul_scalar", "logit_softcap",
    "moe_router", "fused_moe", "sigmoid_gate"})
OPTIONAL_OPS = frozenset({
    "fused_add_rms_norm", "silu_and_mul",
    "embedding_packed", "linear_packed", "linear_packed_q8act", "fused_moe_packed",
    "fused_moe_packed_q8act",
    "sample_tokens", "greedy_tokens", "apply_token_bitmask", "lora_add"})
