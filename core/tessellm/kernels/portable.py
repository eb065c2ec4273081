"""Portable kernels: plain torch that runs on any torch device, never synchronizes with the host
and keeps every shape a function of the input shapes alone.

They are what an accelerator plugin offers for the ops it has no kernel of its own for (the
CUDA plugin next to its Triton kernels, the XLA plugin, whose lazy tensors recompile on every
new shape and stall on every host read). Unlike the reference ops they do not loop over
sequences on the host or index with boolean masks.

`paged_attention_static` handles any mix of sequences in one call, over the whole (padded)
block table: token t belongs to the sequence whose query rows hold it (query_start_loc), sits
at position seq_len - query_len + its row in the sequence, and attends to the positions
<= its own and < seq_len. Rows past query_start_loc[-1] and sequences with seq_len 0 are
padding: their output is 0. The context is processed in chunks of whole blocks with an online
softmax, so the gathered K/V never exceed about `chunk_bytes` per chunk.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tessellm.kernels.attention_metadata import AttentionMetadata
from tessellm.kernels.reference import apply_token_bitmask  # noqa: F401  (portable as it is:
#   no host reads, a boolean mask of the logits' own shape)
from tessellm.kernels.portable_lora import lora_add_dense_slots  # noqa: F401
from tessellm.kernels.portable_moe import fused_moe_dense, fused_moe_packed_dense  # noqa: F401
from tessellm.kernels.reference_moe import moe_router, sigmoid_gate  # noqa: F401  (portable
#   as they are: topk and elementwise math of fixed shapes)
from tessellm.quant.formats import PackedWeight, dequantize

CHUNK_BYTES = 64 << 20


def rms_norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def fused_add_rms_norm(x, residual, weight, eps):
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def layer_norm(x, weight, bias, eps):
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def mul_scalar(x, factor):
    return x * torch.tensor(factor, dtype=torch.float32, device=x.device).to(x.dtype)


def logit_softcap(x, cap):
    return torch.tanh(x / cap) * cap


def silu_and_mul(x):
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def rotary_embedding(positions, q, k, cos_sin, head_dim):
    half = cos_sin.shape[-1] // 2
    cs = cos_sin.index_select(0, positions).to(q.dtype)
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rope(x):
        xh = x.unflatten(-1, (-1, head_dim))   # not reshape(T, -1, D): T may be 0
        x1, x2 = xh[..., :half], xh[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(1)

    return rope(q), rope(k)


def linear_packed_dequant(x, weight: PackedWeight, bias=None):
    return F.linear(x, dequantize(weight, x.dtype), bias)


def embedding_packed_rows(ids, weight: PackedWeight):
    return dequantize(weight.rows(ids))


def write_kv_cache(k, v, kv_cache, slot_mapping):
    """index_put over the slots. A padding token (slot < 0) takes the first real token's slot
    and row, so duplicate indices write equal values and nothing else changes; a step of
    padding alone rewrites slot 0 with its own value. No mask-dependent shapes."""
    _, _, nkv, block_size, hd = kv_cache.shape
    T = slot_mapping.shape[0]
    if T == 0:
        return
    valid = slot_mapping >= 0
    first = torch.argmax(valid.to(torch.int32))          # the first real token (0 if none)
    src = torch.where(valid, torch.arange(T, device=slot_mapping.device), first)
    any_valid = valid.any()
    slots = torch.where(any_valid, slot_mapping[src], torch.zeros_like(slot_mapping))
    blocks, rows = slots // block_size, slots % block_size
    for i, x in enumerate((k, v)):
        new = x.reshape(T, nkv, hd)[src].to(kv_cache.dtype)
        kv_cache[i][blocks, :, rows] = torch.where(any_valid, new, kv_cache[i][blocks, :, rows])


def _chunk_blocks(num_tokens: int, width: int, block_size: int, num_kv_heads: int,
                  head_dim: int, chunk_bytes: int) -> int:
    per_block = max(1, num_tokens) * block_size * num_kv_heads * head_dim * 4 * 2
    return max(1, min(width, chunk_bytes // per_block))


def paged_attention_static(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, sliding_window: int = 0, logit_softcap: float = 0.0,
                           chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Attention of every query row over its sequence's paged K/V (see the module docstring);
    float32 scores and softmax, output in q's dtype. Reads only device tensors.
    sliding_window > 0: keys at positions <= pos - window are hidden; logit_softcap > 0:
    scores become cap * tanh(scores / cap) (as reference.paged_attention)."""
    _, _, nkv, bs, hd = kv_cache.shape
    T = q.shape[0]
    nh = q.shape[1] // hd
    group = nh // nkv
    tables = meta.block_tables.long()
    B, W = tables.shape
    dev = q.device
    qsl = meta.query_start_loc.long()
    seq_lens = meta.seq_lens.long()
    tok = torch.arange(T, device=dev)
    # the sequence of each row: how many sequences end at or before it ([T, B] compare, no
    # searchsorted: lowers everywhere)
    seq = (tok[:, None] >= qsl[None, 1:]).sum(-1).clamp(max=B - 1)
    tok_valid = tok < qsl[-1]
    q_len = (qsl[1:] - qsl[:-1])[seq]
    pos = seq_lens[seq] - q_len + (tok - qsl[:-1][seq])            # [T]
    limit = torch.minimum(pos + 1, seq_lens[seq])                  # keys < limit are visible
    limit = torch.where(tok_valid, limit, torch.zeros_like(limit))
    first = pos - sliding_window + 1 if sliding_window > 0 else None   # keys >= first
    qf = q.reshape(T, nkv, group, hd).float() * scale
    m = torch.full((T, nkv, group), float("-inf"), device=dev)
    l_sum = torch.zeros((T, nkv, group), device=dev)
    acc = torch.zeros((T, nkv, group, hd), device=dev)
    tok_tables = tables[seq]                                       # [T, W]
    step = _chunk_blocks(T, W, bs, nkv, hd, chunk_bytes)
    for b0 in range(0, W, step):
        b1 = min(W, b0 + step)
        blocks = tok_tables[:, b0:b1]                              # [T, n]
        k = kv_cache[0][blocks].float()                            # [T, n, nkv, bs, hd]
        v = kv_cache[1][blocks].float()
        k = k.permute(0, 2, 1, 3, 4).reshape(T, nkv, (b1 - b0) * bs, hd)
        v = v.permute(0, 2, 1, 3, 4).reshape(T, nkv, (b1 - b0) * bs, hd)
        key_pos = torch.arange(b0 * bs, b1 * bs, device=dev)
        visible = key_pos[None, :] < limit[:, None]                # [T, C]
        if first is not None:
            visible = visible & (key_pos[None, :] >= first[:, None])
        s = torch.einsum("tkgd,tkcd->tkgc", qf, k)
        if logit_softcap > 0:
            s = torch.tanh(s / logit_softcap) * logit_softcap
        s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l_sum = l_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("tkgc,tkcd->tkgd", p, v)
        m = m_new
    out = acc / torch.where(l_sum > 0, l_sum, torch.ones_like(l_sum))[..., None]
    return out.reshape(T, nh * hd).to(q.dtype)
