"""Graph-level op targets.

Every device op the graph may contain is a module-level function here whose name is the op name
of the kernel registry; calling it runs the reference implementation, so an unlowered graph is
executable as the reference model. `attention` is a composite: lowering binds it to the device's
write_kv_cache, attention_decode and attention_prefill kernels. Structural functions (views,
splits, row selection) are not device ops and run as plain torch.
"""
from __future__ import annotations

from typing import Callable

import torch

from tessellm.kernels import reference as ref
from tessellm.kernels.attention_metadata import AttentionMetadata


def embedding(ids, weight):
    return ref.embedding(ids, weight)


def linear(x, weight, bias=None):
    return ref.linear(x, weight, bias)


def embedding_packed(ids, weight):
    return ref.embedding_packed(ids, weight)


def linear_packed(x, weight, bias=None):
    return ref.linear_packed(x, weight, bias)


def linear_packed_q8act(x, weight, bias=None):
    return ref.linear_packed_q8act(x, weight, bias)


def rms_norm(x, weight, eps):
    return ref.rms_norm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    return ref.fused_add_rms_norm(x, residual, weight, eps)


def layer_norm(x, weight, bias, eps):
    return ref.layer_norm(x, weight, bias, eps)


def add(a, b):
    return ref.add(a, b)


def mul(a, b):
    return ref.mul(a, b)


def silu(x):
    return ref.silu(x)


def silu_and_mul(x):
    return ref.silu_and_mul(x)


def gelu_tanh(x):
    return ref.gelu_tanh(x)


def mul_scalar(x, factor):
    return ref.mul_scalar(x, factor)


def logit_softcap(x, cap):
    return ref.logit_softcap(x, cap)


def rotary_embedding(positions, q, k, cos_sin, head_dim):
    return ref.rotary_embedding(positions, q, k, cos_sin, head_dim)


def moe_router(router_logits, top_k, renormalize, scoring):
    return ref.moe_router(router_logits, top_k, renormalize, scoring)


def fused_moe(x, w13, w2, topk_weights, topk_ids):
    return ref.fused_moe(x, w13, w2, topk_weights, topk_ids)


def fused_moe_packed(x, w13, w2, topk_weights, topk_ids):
    return ref.fused_moe_packed(x, w13, w2, topk_weights, topk_ids)


def fused_moe_packed_q8act(x, w13, w2, topk_weights, topk_ids):
    return ref.fused_moe_packed_q8act(x, w13, w2, topk_weights, topk_ids)


def sigmoid_gate(gate_logits, y):
    return ref.sigmoid_gate(gate_logits, y)


def lora_add(x, y, lora_a, lora_b, lora_slots):
    return ref.lora_add(x, y, lora_a, lora_b, lora_slots)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
              meta: AttentionMetadata, scale: float, sliding_window: int = 0,
              logit_softcap: float = 0.0) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend (decodes, then prefills).
    sliding_window / logit_softcap (0: off) as reference.paged_attention has them; a node
    that uses them also carries them in its dims (attention_feature_dims), so only kernels
    whose `supports` accepts them are chosen."""
    ref.write_kv_cache(k, v, kv_cache, meta.slot_mapping)
    return ref.paged_attention(q, kv_cache, meta, scale, sliding_window, logit_softcap)


def attention_feature_dims(sliding_window: int = 0, logit_softcap: float = 0.0
                           ) -> dict[str, int]:
    """The kernel-query dims that say an attention call uses a window or a soft-cap (none
    when off, so plain attention keeps its profile buckets): `sliding_window` in tokens and
    `logit_softcap` as the cap in thousandths (dims are ints; the exact float is the call's
    argument, this only selects and buckets kernels)."""
    dims: dict[str, int] = {}
    if sliding_window > 0:
        dims["sliding_window"] = int(sliding_window)
    if logit_softcap > 0:
        dims["logit_softcap"] = max(1, round(logit_softcap * 1000))
    return dims


# Structural helpers (not device ops).
def split_last(x: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    # the tensor method itself: torch.split's Python wrappers cost half of this per-step call
    return x.split_with_sizes(sizes, dim=-1)


def per_head(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return x.unflatten(-1, (-1, head_dim))


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(-2)


def select_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(0, index)


# Tensor parallelism (tessellm.models.sharding). Collectives: lowering binds them to the
# engine's Communicator; called directly they are those of a one-rank group (identity).
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    return x


def all_gather_last(x: torch.Tensor) -> torch.Tensor:
    return x


# Vocab-parallel embedding: a rank holds rows [start, start + size) of the table.
def local_vocab_ids(ids: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Ids as rows of this rank's shard; ids it does not hold map to row 0 (masked after)."""
    local = ids - start
    return torch.where((local >= 0) & (local < size), local, torch.zeros_like(local))


def mask_foreign_rows(x: torch.Tensor, ids: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Zero the embedding rows of ids this rank does not hold (another rank adds them)."""
    held = (ids >= start) & (ids < start + size)
    return torch.where(held.unsqueeze(-1), x, torch.zeros((), dtype=x.dtype, device=x.device))


def narrow_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """The first `size` columns (a gathered vocabulary without its padding rows)."""
    return x[..., :size]


COLLECTIVE_OPS = (all_reduce, all_gather_last)
STRUCTURAL_OPS = (split_last, per_head, merge_heads, select_rows, local_vocab_ids,
                  mask_foreign_rows, narrow_last)


DEVICE_OPS: dict[Callable, str] = {
    fn: fn.__name__ for fn in (
        embedding, linear, embedding_packed, linear_packed, linear_packed_q8act, rms_norm,
        fused_add_rms_norm, layer_norm, add, mul, silu,
        silu_and_mul, gelu_tanh, mul_scalar, logit_softcap,
        rotary_embedding, moe_router, fused_moe, fused_moe_packed,
        fused_moe_packed_q8act, sigmoid_gate, lora_add)
}
COMPOSITE_OPS: dict[Callable, tuple[str, ...]] = {
    attention: ("write_kv_cache", "attention_decode", "attention_prefill"),
}


def op_name(target: object) -> str | None:
    """The registry op name of a graph target, or None for structural functions."""
    if target is attention:
        return "attention"
    return DEVICE_OPS.get(target)  # type: ignore[arg-type]
