"""The reference ops against independent ground truth: transformers' Llama modules for rms_norm
and rotary, a dense causal attention written out here for the paged attention, torch.nn for
the rest."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.activations import NewGELUActivation
from transformers.models.llama.modeling_llama import (LlamaRMSNorm, LlamaRotaryEmbedding,
                                                      apply_rotary_pos_emb)

from tessellm.kernels import reference as ref
from tessellm.kernels.attention_metadata import AttentionMetadata, metadata_from_tables

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ norms and pointwise ops

@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.5])
def test_rms_norm_matches_llama_rms_norm(dtype: torch.dtype, eps: float) -> None:
    g = _gen()
    hf = LlamaRMSNorm(48, eps=eps)
    with torch.no_grad():
        hf.weight.copy_(1 + 0.1 * torch.randn(48, generator=g))
    hf = hf.to(dtype)
    x = (torch.randn(11, 48, generator=g) * 3).to(dtype)
    with torch.no_grad():
        expected = hf(x)
    got = ref.rms_norm(x, hf.weight.detach(), eps)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_rms_norm_of_a_zero_row_is_zero() -> None:
    out = ref.rms_norm(torch.zeros(2, 8), torch.ones(8), 1e-6)
    assert torch.equal(out, torch.zeros(2, 8))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_fused_add_rms_norm_is_add_then_norm(dtype: torch.dtype) -> None:
    g = _gen(1)
    x, r = (torch.randn(5, 32, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(32, generator=g).to(dtype)
    normed, summed = ref.fused_add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, x + r)
    assert torch.equal(normed, ref.rms_norm(x + r, w, 1e-5))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_layer_norm_matches_nn_layer_norm_in_float32(dtype: torch.dtype) -> None:
    g = _gen(2)
    w, b = (torch.randn(24, generator=g).to(dtype) for _ in range(2))
    ln = torch.nn.LayerNorm(24, eps=1e-5)
    with torch.no_grad():
        ln.weight.copy_(w.float())
        ln.bias.copy_(b.float())
    x = torch.randn(7, 24, generator=g).to(dtype)
    with torch.no_grad():
        expected = ln(x.float()).to(dtype)
    got = ref.layer_norm(x, w, b, 1e-5)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(got, expected, **tol)


def test_pointwise_ops_match_torch() -> None:
    g = _gen(3)
    x = torch.randn(6, 20, generator=g)
    torch.testing.assert_close(ref.silu(x), F.silu(x))
    torch.testing.assert_close(ref.silu_and_mul(x), F.silu(x[:, :10]) * x[:, 10:])
    torch.testing.assert_close(ref.gelu_tanh(x), F.gelu(x, approximate="tanh"))
    torch.testing.assert_close(ref.gelu_tanh(x), NewGELUActivation()(x))
    w, b = torch.randn(9, 20, generator=g), torch.randn(9, generator=g)
    torch.testing.assert_close(ref.linear(x, w, b), F.linear(x, w, b))
    torch.testing.assert_close(ref.linear(x, w), F.linear(x, w))
    ids = torch.tensor([3, 0, 3, 8])
    assert torch.equal(ref.embedding(ids, w), F.embedding(ids, w))


# ------------------------------------------------------------------ rotary

def _cos_sin_table(head_dim: int, theta: float, max_pos: int) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "theta"),
                         [(4, 4, 16, 10000.0), (8, 2, 32, 500000.0), (2, 1, 64, 1e6)])
def test_rotary_matches_apply_rotary_pos_emb(dtype: torch.dtype, num_heads: int,
                                             num_kv_heads: int, head_dim: int,
                                             theta: float) -> None:
    max_pos, T = 256, 13
    g = _gen(4)
    config = LlamaConfig(hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
                         num_key_value_heads=num_kv_heads, head_dim=head_dim,
                         max_position_embeddings=max_pos,
                         rope_parameters={"rope_type": "default", "rope_theta": theta})
    positions = torch.randint(0, max_pos, (T,), generator=g)  # unsorted, as in a batch
    q = torch.randn(T, num_heads * head_dim, generator=g).to(dtype)
    k = torch.randn(T, num_kv_heads * head_dim, generator=g).to(dtype)

    cos, sin = LlamaRotaryEmbedding(config)(q, positions.unsqueeze(0))  # [1, T, head_dim]
    heads_first = lambda t: t.view(1, T, -1, head_dim).transpose(1, 2)  # noqa: E731
    hq, hk = apply_rotary_pos_emb(heads_first(q), heads_first(k), cos, sin)
    back = lambda t: t.transpose(1, 2).reshape(T, -1)  # noqa: E731

    got_q, got_k = ref.rotary_embedding(positions, q, k, _cos_sin_table(head_dim, theta, max_pos),
                                        head_dim)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 0}
    torch.testing.assert_close(got_q, back(hq), **tol)
    torch.testing.assert_close(got_k, back(hk), **tol)
    assert got_q.dtype == got_k.dtype == dtype


def test_rotary_at_position_zero_is_identity() -> None:
    q, k = torch.randn(3, 32), torch.randn(3, 16)
    rq, rk = ref.rotary_embedding(torch.zeros(3, dtype=torch.int64), q, k,
                                  _cos_sin_table(16, 10000.0, 8), 16)
    assert torch.equal(rq, q) and torch.equal(rk, k)


# ------------------------------------------------------------------ paged attention

NH, NKV, HD, BS = 8, 2, 16, 4


def _layout(seq_lens: list[int], gen: torch.Generator) -> list[list[int]]:
    """Disjoint shuffled block tables for the sequences."""
    need = [math.ceil(s / BS) for s in seq_lens]
    perm = torch.randperm(sum(need) + 3, generator=gen).tolist()
    tables, cursor = [], 0
    for n in need:
        tables.append(perm[cursor:cursor + n])
        cursor += n
    return tables


def _meta(query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
          num_decodes: int) -> AttentionMetadata:
    return metadata_from_tables(query_lens, seq_lens, tables, num_decodes, BS)


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, causal) v per head, in float64; q/k/v [L, heads * HD]."""
    L = q.shape[0]
    qh = q.double().view(L, NH, HD).transpose(0, 1)                        # [NH, L, HD]
    kh = k.double().view(L, NKV, HD).transpose(0, 1).repeat_interleave(NH // NKV, 0)
    vh = v.double().view(L, NKV, HD).transpose(0, 1).repeat_interleave(NH // NKV, 0)
    scores = qh @ kh.transpose(1, 2) * scale
    future = torch.ones(L, L, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return (probs @ vh).transpose(0, 1).reshape(L, NH * HD)


def _sequence(L: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    return (torch.randn(L, NH * HD, generator=gen), torch.randn(L, NKV * HD, generator=gen),
            torch.randn(L, NKV * HD, generator=gen))


def test_write_kv_cache_stores_each_token_at_its_slot() -> None:
    g = _gen(5)
    _, k, v = _sequence(10, g)
    (table,) = _layout([10], g)
    cache = torch.zeros(2, len(table) + 3, NKV, BS, HD)
    meta = _meta([10], [10], [table], 0)
    ref.write_kv_cache(k, v, cache, meta.slot_mapping)
    for p in range(10):
        b, off = table[p // BS], p % BS
        assert torch.equal(cache[0, b, :, off], k[p].view(NKV, HD))
        assert torch.equal(cache[1, b, :, off], v[p].view(NKV, HD))
    gk, gv = ref.gather_kv(cache, torch.tensor(table), 10, BS)
    assert torch.equal(gk.flatten(1), k) and torch.equal(gv.flatten(1), v)


def test_write_kv_cache_skips_padding_slots() -> None:
    """Slot -1 marks a padding token of a graph-padded batch: nothing is written for it."""
    g = _gen(9)
    _, k, v = _sequence(4, g)
    cache = torch.randn(2, 3, NKV, BS, HD, generator=g)
    before = cache.clone()
    ref.write_kv_cache(k, v, cache, torch.tensor([3, -1, BS + 2, -1]))
    assert torch.equal(cache[0, 0, :, 3], k[0].view(NKV, HD))
    assert torch.equal(cache[1, 1, :, 2], v[2].view(NKV, HD))
    changed = (cache != before).any(dim=(0, 2, 4))    # [block, row]
    assert changed.nonzero().tolist() == [[0, 3], [1, 2]]


@pytest.mark.parametrize(("L", "chunk"), [(37, 37), (37, 11), (37, 1), (8, 8), (1, 1)])
def test_paged_attention_equals_dense_causal_attention(L: int, chunk: int) -> None:
    """The sequence's K/V sit in shuffled blocks; the query is its last `chunk` tokens
    (a full prefill, a chunk over cached context, a one-token step)."""
    g = _gen(6 + L + chunk)
    q, k, v = _sequence(L, g)
    scale = HD ** -0.5
    (table,) = _layout([L], g)
    cache = torch.randn(2, len(table) + 3, NKV, BS, HD, generator=g)  # other blocks: noise
    ref.write_kv_cache(k, v, cache, _meta([L], [L], [table], 0).slot_mapping)
    meta = _meta([chunk], [L], [table], num_decodes=1 if chunk == 1 else 0)
    got = ref.paged_attention(q[L - chunk:], cache, meta, scale)
    expected = _dense_causal(q, k, v, scale)[L - chunk:]
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_batch_equals_each_sequence_alone() -> None:
    g = _gen(7)
    lens, qlens = [1, 23, 9], [1, 23, 4]  # a decode, a fresh prompt, a chunk over context
    seqs = [_sequence(L, g) for L in lens]
    tables = _layout(lens, g)
    cache = torch.randn(2, sum(len(t) for t in tables) + 3, NKV, BS, HD, generator=g)
    for (_, k, v), L, t in zip(seqs, lens, tables):
        ref.write_kv_cache(k, v, cache, _meta([L], [L], [t], 0).slot_mapping)
    q = torch.cat([s[0][L - ql:] for s, L, ql in zip(seqs, lens, qlens)])
    got = ref.paged_attention(q, cache, _meta(qlens, lens, tables, num_decodes=1), HD ** -0.5)
    expected = torch.cat([_dense_causal(*s, HD ** -0.5)[L - ql:]
                          for s, L, ql in zip(seqs, lens, qlens)])
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_paged_attention_keeps_the_query_dtype() -> None:
    g = _gen(8)
    q, k, v = (t.to(torch.bfloat16) for t in _sequence(12, g))
    (table,) = _layout([12], g)
    cache = torch.zeros(2, len(table) + 3, NKV, BS, HD, dtype=torch.bfloat16)
    meta = _meta([12], [12], [table], 0)
    ref.write_kv_cache(k, v, cache, meta.slot_mapping)
    got = ref.paged_attention(q, cache, meta, HD ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _dense_causal(q, k, v, HD ** -0.5),
                               rtol=1.6e-2, atol=2e-2)


# ------------------------------------------------------------------ sampling

def _kept_by_hand(x: list[float], k: int, top_p: float, min_p: float) -> list[int]:
    """The tokens a row keeps, by the contract's words, in float64 Python."""
    vocab = len(x)
    keep = list(range(vocab))
    if k < vocab:
        kth = sorted(x, reverse=True)[k - 1]
        keep = [i for i in keep if x[i] >= kth]
    if top_p < 1.0:
        z = sum(math.exp(x[i]) for i in keep)
        mass, cutoff = 0.0, None
        for i in sorted(keep, key=lambda i: -x[i]):
            if mass >= top_p:
                break
            cutoff = x[i]
            mass += math.exp(x[i]) / z
        keep = [i for i in keep if x[i] >= cutoff]
    if min_p > 0.0:
        top = max(x[i] for i in keep)
        keep = [i for i in keep if math.exp(x[i] - top) >= min_p]
    return keep


def _sample_args(rows: int, vocab: int, g: torch.Generator, params) -> list[torch.Tensor]:
    temperature, top_k, top_p, min_p = zip(*params)
    return [torch.randn(rows, vocab, generator=g) * 3, torch.tensor(temperature),
            torch.tensor(top_k, dtype=torch.int64), torch.tensor(top_p), torch.tensor(min_p),
            torch.empty(rows, vocab).exponential_(generator=g).clamp_min_(1e-38)]


SAMPLE_PARAMS = [(1.0, 100, float("inf"), 0.0), (0.7, 5, float("inf"), 0.0),
                 (1.3, 100, 0.6, 0.0), (1.0, 100, float("inf"), 0.2), (0.9, 12, 0.8, 0.05),
                 (1.5, 1, float("inf"), 0.0), (1.0, 100, 1e-6, 0.0), (1.0, 100, 1.0, 0.0)]


def test_sample_tokens_draws_the_race_winner_among_the_kept_tokens() -> None:
    g = _gen(20)
    args = _sample_args(len(SAMPLE_PARAMS), 100, g, SAMPLE_PARAMS)
    logits, _, _, _, _, noise = args
    got = ref.sample_tokens(*args)
    assert got.dtype == torch.int64
    for row, (t, k, p, mp) in enumerate(SAMPLE_PARAMS):
        x = (logits[row].double() / t).tolist()
        kept = _kept_by_hand(x, k, p, mp)
        winner = max(kept, key=lambda i: math.exp(x[i]) / noise[row, i].item())
        assert got[row].item() == winner, row


def test_sample_tokens_hints_and_off_values_never_change_a_token() -> None:
    """Skipping a filter no row uses, bounding topk by max_top_k, and top_p 1.0 vs +inf give
    the same tokens as running every filter."""
    g = _gen(21)
    args = _sample_args(len(SAMPLE_PARAMS), 100, g, SAMPLE_PARAMS)
    full = ref.sample_tokens(*args)
    on_k = [k for _, k, _, _ in SAMPLE_PARAMS if k < 100]
    assert torch.equal(ref.sample_tokens(*args, max_top_k=max(on_k)), full)
    top_k_rows = [i for i, (_, k, p, mp) in enumerate(SAMPLE_PARAMS)
                  if k < 100 and p >= 1.0 and mp == 0.0]
    sub = [a[top_k_rows] for a in args]
    assert torch.equal(ref.sample_tokens(*sub, use_top_p=False, use_min_p=False,
                                         max_top_k=max(on_k)), full[top_k_rows])
    plain = [i for i, (_, k, p, mp) in enumerate(SAMPLE_PARAMS)
             if k >= 100 and p >= 1.0 and mp == 0.0]
    sub = [a[plain] for a in args]
    assert torch.equal(ref.sample_tokens(*sub, use_top_k=False, use_top_p=False,
                                         use_min_p=False), full[plain])
    one = list(args)
    one[3] = torch.where(args[3] >= 1.0, 1.0, args[3])
    assert torch.equal(ref.sample_tokens(*one), full)
