"""The Triton paged-attention kernels (decode and prefill) against the reference op, run
through Triton's interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1 before
any kernel module is imported). Inputs have shuffled block tables and large garbage in every
slot no sequence owns, so a kernel that reads unmasked slots fails."""
from __future__ import annotations

import math
import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py must set TRITON_INTERPRET=1"

from tessellm.kernels.examples import fill_unowned_slots, make_attention_metadata
from tessellm.kernels.profiler import TOLERANCES
from tessellm.kernels.reference import paged_attention
from tessellm.kernels.registry import KernelQuery
from tessellm_cuda.triton_ops import attention as triton_attention
from tessellm_cuda.triton_ops.attention import (
    _paged_attention_decode,
    paged_attention_decode,
    paged_attention_prefill,
    supports,
)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _inputs(query_lens, seq_lens, num_decodes, block_size, num_heads, num_kv_heads, head_dim,
            dtype, extra_blocks=0, seed=0, q_row_pad=0):
    """(q, kv_cache, meta, scale) with shuffled tables, garbage in unowned slots, block tables
    widened by `extra_blocks` padding entries (block 0) and q a row-strided view when
    q_row_pad > 0."""
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = make_attention_metadata(query_lens, seq_lens, block_size, num_decodes,
                                               "cpu", gen)
    if extra_blocks:
        pad = torch.zeros((meta.block_tables.shape[0], extra_blocks), dtype=torch.int32)
        meta.block_tables = torch.cat([meta.block_tables, pad], 1)
    cache = torch.randn((2, num_blocks, num_kv_heads, block_size, head_dim), generator=gen)
    cache = cache.to(dtype)
    fill_unowned_slots(cache, meta, gen)
    width = num_heads * head_dim
    q = torch.randn((sum(query_lens), width + q_row_pad), generator=gen).to(dtype)[:, :width]
    return q, cache, meta, 1.0 / math.sqrt(head_dim)


def _check(out, q, cache, meta, scale):
    ref = paged_attention(q, cache, meta, scale)
    assert out.shape == ref.shape and out.dtype == q.dtype and out.is_contiguous()
    rtol, atol = TOLERANCES[q.dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)


# (seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, num_splits, extra_blocks)
DECODE_CASES = [
    ([1], 16, 8, 4, 8, F32, 1, 0),                    # stories260K shapes, one token
    ([7, 40, 17], 5, 8, 4, 8, F32, 1, 3),             # non-pow2 blocks, wide table
    ([33, 16, 1, 64], 16, 4, 4, 64, F32, 1, 2),       # GQA 1, exact-block lengths
    ([100, 3], 32, 8, 2, 80, BF16, 1, 0),             # GQA 4, head_dim 80
    ([50, 70], 16, 4, 2, 128, F16, 1, 1),             # GQA 2, head_dim 128
    ([9], 16, 8, 1, 16, F32, 1, 0),                   # GQA 8
    ([300, 20, 1], 16, 4, 2, 64, F32, 4, 0),          # split-K, some splits empty
    ([130, 66], 5, 8, 2, 80, BF16, 2, 0),             # split-K, non-pow2 blocks
    ([45], 32, 4, 1, 128, F16, 8, 5),                 # more splits than tiles
    ([100], 16, 4, 2, 64, F32, None, 300),            # heuristic: wide table -> 16 splits
    ([3, 8, 1], 1, 4, 2, 64, F32, 2, 2),              # block_size 1
    ([31, 95], 32, 8, 4, 96, F16, 1, 0),              # head_dim 96
    ([60, 129], 16, 4, 1, 128, BF16, 2, 0),           # GQA 4, head_dim 128, bf16
    ([21], 8, 2, 1, 256, F32, 1, 0),                  # head_dim 256
]


@pytest.mark.parametrize("seq_lens,block_size,nh,nkv,hd,dtype,num_splits,extra", DECODE_CASES)
def test_decode_matches_reference(seq_lens, block_size, nh, nkv, hd, dtype, num_splits, extra):
    n = len(seq_lens)
    q, cache, meta, scale = _inputs([1] * n, seq_lens, n, block_size, nh, nkv, hd, dtype,
                                    extra_blocks=extra, q_row_pad=8 if n > 1 else 0)
    if num_splits is None:
        assert triton_attention._decode_num_splits(
            n, nkv, meta.block_tables.shape[1] * block_size) == 16
        out = paged_attention_decode(q, cache, meta, scale)
    else:
        out = _paged_attention_decode(q, cache, meta, scale, num_splits=num_splits)
    _check(out, q, cache, meta, scale)


# (query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, dtype)
PREFILL_CASES = [
    ([1], [1], 16, 8, 4, 8, F32),                     # a single one-token sequence
    ([5], [5], 5, 8, 4, 8, F32),                      # stories260K shapes, non-pow2 blocks
    ([1], [200], 16, 4, 2, 64, F32),                  # one-token chunk after long context
    ([20, 33, 7], [20, 60, 7], 16, 4, 2, 64, F32),    # with and without prior context
    ([70, 3], [90, 10], 32, 8, 2, 80, BF16),          # GQA 4, two m-blocks
    ([17, 40], [17, 55], 5, 4, 4, 128, F16),          # GQA 1, head_dim 128
    ([12, 1], [12, 30], 16, 8, 1, 16, BF16),          # GQA 8
    ([130], [200], 16, 4, 2, 64, F32),                # three m-blocks after prior context
    ([9, 1, 4], [9, 40, 6], 1, 4, 2, 64, F16),        # block_size 1
    ([50, 24], [80, 24], 32, 8, 2, 128, BF16),        # GQA 4, head_dim 128, bf16
    ([19], [33], 7, 2, 1, 256, F32),                  # head_dim 256
]


@pytest.mark.parametrize("query_lens,seq_lens,block_size,nh,nkv,hd,dtype", PREFILL_CASES)
def test_prefill_matches_reference(query_lens, seq_lens, block_size, nh, nkv, hd, dtype):
    q, cache, meta, scale = _inputs(query_lens, seq_lens, 0, block_size, nh, nkv, hd, dtype,
                                    extra_blocks=2, q_row_pad=16)
    _check(paged_attention_prefill(q, cache, meta, scale), q, cache, meta, scale)


def test_tensor_core_path_logic(monkeypatch):
    """The GPU's 16-bit dot path (probabilities cast to K/V's dtype) is numerically sound;
    run with fp16, whose tl.dot the interpreter computes correctly (its bf16 one is not)."""
    monkeypatch.setattr(triton_attention, "_interpreting", lambda: False)
    q, cache, meta, scale = _inputs([1, 1], [37, 80], 2, 16, 4, 2, 64, F16)
    _check(_paged_attention_decode(q, cache, meta, scale, num_splits=2), q, cache, meta, scale)
    q, cache, meta, scale = _inputs([30, 4], [30, 50], 0, 5, 4, 2, 80, F16, seed=1)
    _check(paged_attention_prefill(q, cache, meta, scale), q, cache, meta, scale)


@pytest.mark.parametrize("num_splits", [1, 4])
def test_decode_reads_lengths_on_device(num_splits):
    """Wrong host-side lengths change nothing; shorter device lengths change the result to
    the reference's at those lengths (the launch a CUDA graph replays)."""
    seq_lens = [40, 23, 64]
    q, cache, meta, scale = _inputs([1] * 3, seq_lens, 3, 16, 4, 2, 64, F32)
    expected = _paged_attention_decode(q, cache, meta, scale, num_splits=num_splits)
    meta.seq_lens_host, meta.max_seq_len = [1, 999, 2], 999
    again = _paged_attention_decode(q, cache, meta, scale, num_splits=num_splits)
    torch.testing.assert_close(again, expected, rtol=0, atol=0)

    shorter = [17, 5, 64]
    meta.seq_lens.copy_(torch.tensor(shorter, dtype=torch.int32))  # host lists stay stale
    out = _paged_attention_decode(q, cache, meta, scale, num_splits=num_splits)
    meta.seq_lens_host, meta.max_seq_len = shorter, max(shorter)
    _check(out, q, cache, meta, scale)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_empty_sequence_gives_zeros(num_splits):
    """A batch slot with seq_len 0 on the device (e.g. padding of a captured batch) yields
    zeros, not NaN, and leaves the other sequences intact."""
    q, cache, meta, scale = _inputs([1, 1], [1, 26], 2, 16, 4, 2, 64, F32)
    meta.seq_lens[0] = 0
    out = _paged_attention_decode(q, cache, meta, scale, num_splits=num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1], paged_attention(q, cache, meta, scale)[1],
                               rtol=1e-5, atol=1e-4)


def test_decode_split_count_is_a_function_of_shapes():
    f = triton_attention._decode_num_splits
    assert f(1, 1, 64) == 1
    assert f(64, 8, 8192) == 1          # 512 programs already fill the GPU
    assert f(1, 4, 1024) == 4           # each split keeps >= 256 slots
    assert f(1, 4, 1023) == 2
    assert f(1, 1, 1 << 20) == 16


def test_supports():
    def query(hd, nh=8, nkv=4, dtype=BF16):
        return KernelQuery("attention_decode", dtype, 8,
                           (("num_heads", nh), ("num_kv_heads", nkv), ("head_dim", hd),
                            ("block_size", 16)))
    assert supports(query(8)) and supports(query(128)) and supports(query(256, dtype=F32))
    assert not supports(query(512))
    assert not supports(query(64, nh=6, nkv=4))
    assert not supports(query(64, dtype=torch.float64))


# ------------------------------------------------------- sliding window and logit soft-cap

# (query_lens, seq_lens, decode?, block_size, heads, kv heads, head_dim, dtype, window, cap,
# num_splits): windows shorter than the context (inside a block, across blocks, shorter than
# a prefill chunk), soft-caps small enough to bite, both at once, decode splits
WINDOW_SOFTCAP_CASES = [
    ([1, 1, 1], [33, 5, 70], True, 16, 8, 2, 64, F32, 7, 0.0, 1),
    ([1, 1], [70, 9], True, 16, 4, 4, 32, F32, 20, 0.0, 4),
    ([1, 1, 1], [33, 5, 70], True, 8, 8, 2, 64, F32, 0, 2.0, 1),
    ([1, 1], [70, 40], True, 16, 4, 2, 32, BF16, 11, 3.0, 2),
    ([9, 3, 40], [9, 30, 40], False, 16, 4, 2, 32, F32, 5, 0.0, None),
    ([20, 6], [20, 50], False, 8, 4, 4, 64, F32, 0, 2.5, None),
    ([33, 4], [33, 21], False, 16, 8, 2, 32, BF16, 13, 4.0, None),
]


@pytest.mark.parametrize("case", WINDOW_SOFTCAP_CASES,
                         ids=[f"{'dec' if c[2] else 'pre'}-w{c[8]}-cap{c[9]}-{str(c[7])[6:]}"
                              for c in WINDOW_SOFTCAP_CASES])
def test_window_and_softcap_match_reference(case) -> None:
    qlens, slens, decode, bs, nh, nkv, hd, dt, window, cap, splits = case
    q, cache, meta, scale = _inputs(qlens, slens, len(qlens) if decode else 0, bs, nh, nkv, hd,
                                    dt, extra_blocks=1, seed=11)
    if decode:
        out = _paged_attention_decode(q, cache, meta, scale, splits, window, cap)
    else:
        out = paged_attention_prefill(q, cache, meta, scale, window, cap)
    ref = paged_attention(q, cache, meta, scale, window, cap)
    plain = paged_attention(q, cache, meta, scale)
    assert (ref.float() - plain.float()).abs().max() > 1e-2   # the feature changes the output
    rtol, atol = TOLERANCES[dt]
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol)
