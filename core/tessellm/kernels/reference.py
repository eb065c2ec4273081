"""Reference implementations of every op the graph uses, in plain torch.

They are the ground truth in tests and in the profiler's correctness check, written for
clarity, not speed. Numerics follow Hugging Face transformers: norms compute in float32 and
cast back; rotary cos/sin are built in float32 and cast to the activation dtype; attention
softmax runs in float32.
Shapes: activations are [num_tokens, features]; heads are packed in the feature dim.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tessellm.kernels.attention_metadata import AttentionMetadata
from tessellm.kernels.reference_lora import lora_add
from tessellm.kernels.reference_moe import (fused_moe, fused_moe_packed,
                                            fused_moe_packed_q8act, moe_router, sigmoid_gate)
from tessellm.quant.formats import PackedWeight, dequantize


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight[ids]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x @ weight.t() + bias if bias is not None else x @ weight.t()


def embedding_packed(ids: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """Rows of a packed embedding, dequantized to its compute dtype."""
    return dequantize(weight.rows(ids))


def linear_packed(x: torch.Tensor, weight: PackedWeight,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W.T (+ bias) over the dequantized weight, in float32, cast to x's dtype."""
    out = x.float() @ dequantize(weight, torch.float32).t()
    return (out + bias.float() if bias is not None else out).to(x.dtype)


def quantize_q8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x (float32 math) with each 32-value block of its last dim rounded as an int8 block:
    d = max|x| / 127, x -> round-half-even(x / d) * d (an all-zero block stays zero). This is
    what a Q8_0 activation block holds (with d kept in float32)."""
    blocks = x.float().unflatten(-1, (-1, 32))
    d = blocks.abs().amax(-1, keepdim=True) / 127
    q = torch.where(d > 0, torch.round(blocks / torch.where(d > 0, d, 1.0)), 0.0)
    return (q * d).flatten(-2)


def linear_packed_q8act(x: torch.Tensor, weight: PackedWeight,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_packed with the input's 32-value blocks first rounded to int8
    (quantize_q8_blocks): llama.cpp's way of running a quantized model, opt-in
    (EngineConfig.packed_activations = "q8_0") since it changes the numbers."""
    return linear_packed(quantize_q8_blocks(x), weight, bias).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * b


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half of the last dim."""
    d = x.shape[-1] // 2
    return silu(x[..., :d]) * x[..., d:]


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def mul_scalar(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x times `factor` rounded to float32 and then to x's dtype (Gemma's embedding scale:
    transformers keeps it as a float32 buffer and multiplies in the weights' dtype)."""
    return x * torch.tensor(factor, dtype=torch.float32, device=x.device).to(x.dtype)


def logit_softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap) in x's dtype, in transformers' order (divide, tanh, multiply):
    Gemma 2's final logit soft-capping."""
    return torch.tanh(x / cap) * cap


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return torch.cat((-x[..., d:], x[..., :d]), dim=-1)


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-split (GPT-NeoX / HF) rotary embedding over the whole head dim.

    cos_sin: [max_positions, head_dim] float32, cos in the first half, sin in the second (the
    half-width tables, duplicated across both halves of the head as HF does).
    """
    half = cos_sin.shape[-1] // 2
    cs = cos_sin[positions]
    cos = torch.cat((cs[:, :half], cs[:, :half]), -1).to(q.dtype).unsqueeze(1)
    sin = torch.cat((cs[:, half:], cs[:, half:]), -1).to(q.dtype).unsqueeze(1)

    def rope(x: torch.Tensor) -> torch.Tensor:
        xh = x.unflatten(-1, (-1, head_dim))
        return (xh * cos + _rotate_half(xh) * sin).flatten(-2)

    return rope(q), rope(k)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store each token's K and V at its slot. k, v: [num_tokens, num_kv_heads * head_dim].
    A negative slot marks a padding token (a graph-padded batch): nothing is written for it."""
    _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, :, offsets] = k.view(-1, num_kv_heads, head_dim)[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, :, offsets] = v.view(-1, num_kv_heads, head_dim)[keep].to(kv_cache.dtype)


def gather_kv(kv_cache: torch.Tensor, block_table_row: torch.Tensor, seq_len: int,
              block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one sequence as [seq_len, num_kv_heads, head_dim]."""
    n_blocks = (seq_len + block_size - 1) // block_size
    blocks = block_table_row[:n_blocks].long()
    k = kv_cache[0, blocks].transpose(1, 2).flatten(0, 1)[:seq_len]
    v = kv_cache[1, blocks].transpose(1, 2).flatten(0, 1)[:seq_len]
    return k, v


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, sliding_window: int = 0,
                    logit_softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of each sequence's query tokens over its cached K/V (the new tokens'
    K/V must already be written). q: [num_tokens, num_heads * head_dim]. GQA by head groups.

    sliding_window > 0: a query at position p sees only the keys at positions > p - window
    (the `window` latest, its own included: transformers' sliding_window_overlay).
    logit_softcap > 0: scores become cap * tanh(scores / cap) before the mask and softmax
    (Gemma 2's attention soft-capping)."""
    num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[4]
    out = torch.empty_like(q)
    qsl = meta.query_start_loc.tolist()
    for i in range(meta.num_seqs):
        s, e = qsl[i], qsl[i + 1]
        if e == s:   # no query rows (a static-shape padding sequence): no output
            continue
        seq_len = meta.seq_lens_host[i]
        qi = q[s:e].view(e - s, -1, head_dim).float()
        k, v = gather_kv(kv_cache, meta.block_tables[i], seq_len, meta.block_size)
        group = qi.shape[1] // num_kv_heads
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        if logit_softcap > 0:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap
        q_pos = torch.arange(seq_len - (e - s), seq_len, device=q.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if sliding_window > 0:
            hidden = hidden | (k_pos <= q_pos - sliding_window)
        scores = scores.masked_fill(hidden, float("-inf"))
        probs = scores.softmax(-1)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).flatten(1).to(q.dtype)
    return out


# ---- sampling -----------------------------------------------------------------------------

def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The greedy token of each row of logits [n, vocab] (any float dtype): int64 [n], the
    index of the row's largest value, ties to the lowest index and a NaN counting as larger
    than any number (its first NaN wins), as torch.argmax orders them. torch.max(...).indices
    follows the same rule and runs several times faster than torch.argmax on the CPU."""
    return torch.max(logits, dim=-1).indices


_BIT_VALUES = [1 << k if k < 31 else -(1 << 31) for k in range(32)]   # bit k as an int32


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: every token a row's bitmask forbids gets -inf. logits [n, vocab] (any float
    dtype); bitmask [n, ceil(vocab / 32)] int32, token t allowed iff bit t % 32 (least
    significant first) of word t // 32 is set; the bits past `vocab` are ignored. A row of
    all-ones words (-1) leaves its logits as they are. (llguidance's and xgrammar's layout.)"""
    vocab = logits.shape[1]
    # each word against the 32 one-bit values (an AND, not shifts: torch-xla 2.9 broadcasts
    # an int32 right shift wrongly, and this must run there as the portable kernel)
    bits = torch.tensor(_BIT_VALUES, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) & bits) != 0).flatten(1)[:, :vocab]
    logits.masked_fill_(~allowed, float("-inf"))


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, noise: torch.Tensor, *,
                  use_top_k: bool = True, use_top_p: bool = True, use_min_p: bool = True,
                  max_top_k: int | None = None) -> torch.Tensor:
    """One token id per row by temperature, top-k, top-p, min-p and the exponential race.

    logits [n, vocab] (any float dtype); temperature [n] float32 (> 0); top_k [n] int64
    (>= vocab: off); top_p [n] float32 (>= 1: off); min_p [n] float32 (0: off); noise
    [n, vocab] float32 Exponential(1) draws, strictly positive. Returns int64 [n] on the
    logits' device. Per row:

        x = float32(logits) / temperature
        -> top-k: keep x >= the k-th largest value (ties at the cut-off kept)
        -> top-p: keep the smallest most-probable prefix of the sorted row whose mass >= top_p
                  (mass_before < top_p; the top token always kept, ties at the cut-off kept)
        -> min-p: drop tokens whose prob < min_p * max prob
        -> argmax(softmax(x) / noise) (the first index on ties, as torch.argmax)

    Filters mask to -inf. Nothing here synchronizes with the host. The keywords are host-side
    hints (only this torch reference takes them; a kernel has the six positional arguments):
    `use_*=False` skips a filter the caller knows no row uses (a row that does not use a
    filter passes it unchanged, so the result is the same either way), and `max_top_k`, an
    upper bound on every top_k below vocab, lets top-k without top-p read `topk(max_top_k)`
    instead of a full sort.
    """
    x = logits.float() / temperature.unsqueeze(1)
    if use_top_p:
        x = _top_k_top_p(x, top_k if use_top_k else None, top_p)
    elif use_top_k:
        x = _top_k(x, top_k, max_top_k)
    if use_min_p:
        x = _min_p(x, min_p)
    return (torch.softmax(x, dim=-1) / noise).argmax(dim=-1)


def _kth_threshold(sorted_desc: torch.Tensor, top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """Each row's k-th largest value, [n, 1], from its values sorted in descending order (its
    first max(k) of them at least); -inf for rows with k >= vocab (top-k off)."""
    k = top_k.clamp(1, sorted_desc.shape[1]).unsqueeze(1)
    kth = sorted_desc.gather(1, k - 1)
    return kth.masked_fill(top_k.unsqueeze(1) >= vocab, float("-inf"))


def _top_k(x: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None = None) -> torch.Tensor:
    """Mask to -inf every token below its row's k-th largest value (ties at the k-th are kept)."""
    vocab = x.shape[1]
    if max_top_k is None or max_top_k >= vocab:
        values = x.sort(dim=-1, descending=True).values
    else:
        values = x.topk(max(1, max_top_k), dim=-1).values
    return x.masked_fill(x < _kth_threshold(values, top_k, vocab), float("-inf"))


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
                 ) -> torch.Tensor:
    """Top-k (if `top_k`) then top-p, from one descending sort of the values (no indices)."""
    vocab = x.shape[1]
    sorted_x = x.sort(dim=-1, descending=True).values
    if top_k is not None:
        kth = _kth_threshold(sorted_x, top_k, vocab)
        x = x.masked_fill(x < kth, float("-inf"))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    # top_p >= 1 rows get +inf so float rounding in the cumulative sum never trims their tail.
    top_p = torch.where(top_p >= 1.0, float("inf"), top_p.float()).unsqueeze(1)
    sorted_probs = torch.softmax(sorted_x, dim=-1)
    cumulative = sorted_probs.cumsum(dim=-1)
    mass_before = torch.cat([torch.zeros_like(cumulative[:, :1]), cumulative[:, :-1]], dim=1)
    # The kept set is a prefix of the sorted row (mass_before never decreases); position 0 has
    # mass_before == 0 < top_p, so at least the top token is kept.
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True)
    cutoff = sorted_x.gather(1, num_kept - 1)
    return x.masked_fill(x < cutoff, float("-inf"))


def _min_p(x: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times their row's largest probability."""
    probs = torch.softmax(x, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.float().unsqueeze(1)
    return x.masked_fill(probs < threshold, float("-inf"))


# The ops the graph may contain and the reference of each; attention_prefill and
# attention_decode are paged_attention restricted to prefill / decode sequences.
REFERENCE_OPS = {
    "embedding": embedding,
    "linear": linear,
    "embedding_packed": embedding_packed,
    "linear_packed": linear_packed,
    "linear_packed_q8act": linear_packed_q8act,
    "rms_norm": rms_norm,
    "fused_add_rms_norm": fused_add_rms_norm,
    "layer_norm": layer_norm,
    "add": add,
    "mul": mul,
    "silu": silu,
    "silu_and_mul": silu_and_mul,
    "gelu_tanh": gelu_tanh,
    "mul_scalar": mul_scalar,
    "logit_softcap": logit_softcap,
    "rotary_embedding": rotary_embedding,
    "write_kv_cache": write_kv_cache,
    "attention_prefill": paged_attention,
    "attention_decode": paged_attention,
    "sample_tokens": sample_tokens,
    "greedy_tokens": greedy_tokens,
    "apply_token_bitmask": apply_token_bitmask,
    "moe_router": moe_router,
    "fused_moe": fused_moe,
    "fused_moe_packed": fused_moe_packed,
    "fused_moe_packed_q8act": fused_moe_packed_q8act,
    "sigmoid_gate": sigmoid_gate,
    "lora_add": lora_add,
}
