"""CPU attention over the paged KV cache: two candidates each for decode and prefill.

All read K/V through the block tables (see AttentionMetadata) and use torch's fused
scaled_dot_product_attention (float32 accumulation inside, grouped-query heads native).
- decode_batched_sdpa: gather every sequence's blocks into one padded batch, one SDPA call
  with a key-padding mask.
- decode_batched_bmm: the same gather, then grouped-head batched matmuls and a float32 softmax.
- decode_per_seq_sdpa: one SDPA call per sequence over exactly its keys (no padding).
- prefill_per_seq_sdpa: one SDPA call per sequence; causal with the offset of cached context.
- prefill_batched_sdpa: pad queries and keys of all sequences, one SDPA call with a mask.
- prefill_per_seq_eager: per sequence, float32 scores by matmul, masks, softmax, matmul.

Every kernel takes the reference's sliding_window (keys at positions <= p - window hidden,
by the mask or by the keys it reads). SDPA cannot soft-cap its scores, so only
decode_batched_bmm and prefill_per_seq_eager take logit_softcap (`supports_softcap`); the
others refuse a query with it (`no_softcap`), so the profiler never picks them there.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tessellm.plugin_api import AttentionMetadata, KernelQuery


def no_softcap(query: KernelQuery) -> bool:
    """The SDPA kernels: any query without a logit soft-cap."""
    return "logit_softcap" not in dict(query.dims)


def _gather_padded(kv_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each sequence, padded: [B, num_kv_heads, L, head_dim], L = blocks*block_size.

    Slots past a sequence's length are read too; the KV cache contract (AttentionMetadata)
    guarantees they are finite, so masking their scores is enough.
    """
    block_size = kv_cache.shape[3]
    n_blocks = (max_len + block_size - 1) // block_size
    bt = block_tables[:, :n_blocks].long()
    k = kv_cache[0][bt].transpose(1, 2).flatten(2, 3)     # [B, nkv, n_blocks * block_size, D]
    v = kv_cache[1][bt].transpose(1, 2).flatten(2, 3)
    return k, v


def _seq_kv(kv_cache: torch.Tensor, table: torch.Tensor, seq_len: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence: [1, num_kv_heads, seq_len, head_dim]."""
    block_size = kv_cache.shape[3]
    blocks = table[:(seq_len + block_size - 1) // block_size].long()
    k = kv_cache[0][blocks].transpose(0, 1).flatten(1, 2)[:, :seq_len]   # [nkv, seq_len, D]
    v = kv_cache[1][blocks].transpose(0, 1).flatten(1, 2)[:, :seq_len]
    return k.unsqueeze(0), v.unsqueeze(0)


def _softcap_unsupported(kernel: str, logit_softcap: float) -> None:
    if logit_softcap > 0:
        raise ValueError(f"{kernel} cannot soft-cap attention scores (its supports() refuses "
                         "a logit_softcap query)")


def _decode_visible(L: int, seq_lens: torch.Tensor, sliding_window: int,
                    device: torch.device) -> torch.Tensor:
    """[B, L] bool: key slot j of sequence b is attended by its one query (at seq_len - 1)."""
    key = torch.arange(L, device=device)
    lens = seq_lens.unsqueeze(1)
    visible = key < lens
    if sliding_window > 0:
        visible = visible & (key > lens - 1 - sliding_window)
    return visible


def decode_batched_sdpa(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, sliding_window: int = 0,
                        logit_softcap: float = 0.0) -> torch.Tensor:
    _softcap_unsupported("decode_batched_sdpa", logit_softcap)
    head_dim = kv_cache.shape[-1]
    B = meta.num_seqs
    k, v = _gather_padded(kv_cache, meta.block_tables, meta.max_seq_len)
    mask = _decode_visible(k.shape[2], meta.seq_lens, sliding_window, q.device)
    qh = q.view(B, -1, 1, head_dim)
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask.view(B, 1, 1, -1),
                                         scale=scale, enable_gqa=True)
    return out.reshape(B, -1)


def decode_batched_bmm(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, sliding_window: int = 0,
                       logit_softcap: float = 0.0) -> torch.Tensor:
    """Grouped heads as batched matmuls (scores in the cache dtype, softmax in float32):
    for one query token per sequence this beats SDPA's tiled kernel on the CPU."""
    nkv, head_dim = kv_cache.shape[2], kv_cache.shape[4]
    B = meta.num_seqs
    k, v = _gather_padded(kv_cache, meta.block_tables, meta.max_seq_len)   # [B, nkv, L, D]
    L = k.shape[2]
    qg = q.view(B, nkv, -1, head_dim)                                      # [B, nkv, G, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale         # [B, nkv, G, L]
    if logit_softcap > 0:
        scores = torch.tanh(scores / logit_softcap) * logit_softcap
    pad = ~_decode_visible(L, meta.seq_lens, sliding_window, q.device)     # [B, L]
    scores.masked_fill_(pad.view(B, 1, 1, L), float("-inf"))
    probs = scores.softmax(-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(B, -1)


def decode_per_seq_sdpa(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, sliding_window: int = 0,
                        logit_softcap: float = 0.0) -> torch.Tensor:
    _softcap_unsupported("decode_per_seq_sdpa", logit_softcap)
    head_dim = kv_cache.shape[-1]
    out = torch.empty_like(q)
    for i, seq_len in enumerate(meta.seq_lens_host):
        k, v = _seq_kv(kv_cache, meta.block_tables[i], seq_len)
        if 0 < sliding_window < seq_len:   # only the window's keys
            k, v = k[:, :, seq_len - sliding_window:], v[:, :, seq_len - sliding_window:]
        qi = q[i].view(1, -1, 1, head_dim)
        out[i] = F.scaled_dot_product_attention(qi, k, v, scale=scale, enable_gqa=True).reshape(-1)
    return out


def _causal_offset_mask(q_len: int, seq_len: int, device: torch.device,
                        sliding_window: int = 0) -> torch.Tensor:
    """[q_len, seq_len] bool: query i (at position seq_len-q_len+i) sees keys <= its position
    (and, with a window, > its position - window)."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device).unsqueeze(1)
    key = torch.arange(seq_len, device=device).unsqueeze(0)
    mask = key <= q_pos
    if sliding_window > 0:
        mask = mask & (key > q_pos - sliding_window)
    return mask


def prefill_per_seq_sdpa(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, sliding_window: int = 0,
                         logit_softcap: float = 0.0) -> torch.Tensor:
    _softcap_unsupported("prefill_per_seq_sdpa", logit_softcap)
    head_dim = kv_cache.shape[-1]
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        k, v = _seq_kv(kv_cache, meta.block_tables[i], seq_len)
        qi = q[start:start + q_len].view(q_len, -1, head_dim).transpose(0, 1).unsqueeze(0)
        if q_len == seq_len and not 0 < sliding_window < seq_len:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            mask = _causal_offset_mask(q_len, seq_len, q.device, sliding_window)
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[start:start + q_len] = o[0].transpose(0, 1).reshape(q_len, -1)
        start += q_len
    return out


def prefill_per_seq_eager(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                          scale: float, sliding_window: int = 0,
                          logit_softcap: float = 0.0) -> torch.Tensor:
    """Per sequence: float32 scores of its query rows over exactly its keys (grouped heads as
    batched matmuls), soft-capped, masked (causal, window), softmax, then P.V."""
    nkv, head_dim = kv_cache.shape[2], kv_cache.shape[4]
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        if q_len == 0:
            continue
        k, v = _seq_kv(kv_cache, meta.block_tables[i], seq_len)           # [1, nkv, L, D]
        qi = q[start:start + q_len].view(q_len, nkv, -1, head_dim).permute(1, 2, 0, 3)
        scores = torch.matmul(qi.float(), k[0].float().unsqueeze(1).transpose(-1, -2)) * scale
        if logit_softcap > 0:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        mask = _causal_offset_mask(q_len, seq_len, q.device, sliding_window)
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)        # [nkv, G, q, L]
        o = torch.matmul(probs, v[0].float().unsqueeze(1))                  # [nkv, G, q, D]
        out[start:start + q_len] = o.permute(2, 0, 1, 3).reshape(q_len, -1).to(q.dtype)
        start += q_len
    return out


def prefill_batched_sdpa(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                         scale: float, sliding_window: int = 0,
                         logit_softcap: float = 0.0) -> torch.Tensor:
    _softcap_unsupported("prefill_batched_sdpa", logit_softcap)
    head_dim = kv_cache.shape[-1]
    B, max_q = meta.num_seqs, meta.max_query_len
    k, v = _gather_padded(kv_cache, meta.block_tables, meta.max_seq_len)
    L = k.shape[2]
    q_lens = torch.tensor(meta.query_lens_host, device=q.device)
    starts = meta.query_start_loc[:-1].long()
    row = torch.arange(max_q, device=q.device)
    valid = row.unsqueeze(0) < q_lens.unsqueeze(1)                        # [B, max_q]
    src = (starts.unsqueeze(1) + row.unsqueeze(0)).clamp(max=q.shape[0] - 1)
    qh = q[src].view(B, max_q, -1, head_dim).transpose(1, 2)               # [B, H, max_q, D]
    seq_lens = meta.seq_lens.long()
    q_pos = seq_lens.unsqueeze(1) - q_lens.unsqueeze(1) + row.unsqueeze(0)  # [B, max_q]
    key = torch.arange(L, device=q.device)
    mask = (key.view(1, 1, L) <= q_pos.unsqueeze(2)) & (key.view(1, 1, L) < seq_lens.view(B, 1, 1))
    if sliding_window > 0:
        mask = mask & (key.view(1, 1, L) > q_pos.unsqueeze(2) - sliding_window)
    mask = mask | ~valid.unsqueeze(2) & (key.view(1, 1, L) == 0)          # padded rows see key 0
    o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask.unsqueeze(1), scale=scale,
                                       enable_gqa=True)
    return o.transpose(1, 2).reshape(B * max_q, -1)[valid.flatten()]
