"""The C decode kernel (native/paged_attention.c) against the reference paged attention, and
its input checks.

Head sizes 64 and 128 (compiled with the size as a constant) and 80, 96 (run-time size), block
sizes 16 and 32, float32 and bfloat16, batches with partial last blocks, block-aligned and
single-token sequences, block tables padded past what each sequence uses, and garbage in every
slot no sequence owns. Bad inputs (a length past the table, a block id outside the pool, heads
not a multiple of KV heads, a negative length) raise a ValueError naming the problem instead of
reading out of bounds; a failed scratch allocation returns its code without breaking the
OpenMP team (the next call works).
"""
from __future__ import annotations

import ctypes
import dataclasses
import math

import pytest
import torch
from tessellm_cpu.native_attention import PD_ERR_ALLOC, PD_OK, DecodeArgs, NativeDecode

from tessellm.kernels.examples import pad_block_tables, paged_attention_case
from tessellm.kernels.reference import paged_attention

NUM_HEADS, NUM_KV_HEADS = 8, 2
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 5e-2}}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def native() -> NativeDecode:
    return NativeDecode()


def _case(seq_lens: list[int], block_size: int, head_dim: int, dtype: torch.dtype,
          pad_columns: int = 0, num_heads: int = NUM_HEADS, num_kv_heads: int = NUM_KV_HEADS,
          seed: int = 0):
    q, cache, meta, scale = paged_attention_case(
        [1] * len(seq_lens), seq_lens, len(seq_lens), block_size, num_heads, num_kv_heads,
        head_dim, dtype, "cpu", torch.Generator().manual_seed(seed))
    return q, cache, pad_block_tables(meta, pad_columns), scale


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_decode_matches_reference(native: NativeDecode, head_dim: int, block_size: int,
                                  dtype: torch.dtype) -> None:
    # partial last blocks, exact block multiples, a single token, one long sequence
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 5, 150]
    q, cache, meta, scale = _case(seq_lens, block_size, head_dim, dtype, pad_columns=2)
    assert meta.block_tables.shape[1] > math.ceil(max(seq_lens) / block_size)   # padded
    expected = paged_attention(q, cache, meta, scale)
    assert not expected.float().isnan().any()
    got = native(q, cache, meta, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("block_size", [1, 8, 24])
def test_decode_with_blocks_not_a_multiple_of_16_rows(native: NativeDecode, block_size: int,
                                                      dtype: torch.dtype) -> None:
    """Blocks of 1, 8 and 24 rows: every block folds a row count the 16-row score groups do
    not divide; two sequences (the context split into runs over the threads) and seven."""
    for seq_lens in ([3 * block_size + 1, 2], [1, 5, 9, 40, 41, 17, 3 * block_size]):
        q, cache, meta, scale = _case(seq_lens, block_size, 64, dtype, pad_columns=1)
        torch.testing.assert_close(native(q, cache, meta, scale),
                                   paged_attention(q, cache, meta, scale), **TOL[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_one_long_sequence_split_into_runs(native: NativeDecode, dtype: torch.dtype) -> None:
    """One sequence of 1000 tokens: its blocks are split into runs over the threads and merged;
    the query's largest scores sit in the last run, so every earlier run is rescaled."""
    q, cache, meta, scale = _case([1000], 16, 128, dtype, num_heads=4, num_kv_heads=4)
    last_block = int(meta.block_tables[0, (1000 - 1) // 16])
    cache[0, last_block, :, :7] = q.view(4, 128)[:, None, :].to(dtype) * 4   # K rows 992..998
    torch.testing.assert_close(native(q, cache, meta, scale),
                               paged_attention(q, cache, meta, scale), **TOL[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_decode_without_grouping_and_with_int64_tables(native: NativeDecode,
                                                      dtype: torch.dtype) -> None:
    q, cache, meta, scale = _case([5, 40, 17], 16, 80, dtype, num_heads=4, num_kv_heads=4)
    meta = dataclasses.replace(meta, block_tables=meta.block_tables.to(torch.int64))
    torch.testing.assert_close(native(q, cache, meta, scale),
                               paged_attention(q, cache, meta, scale), **TOL[dtype])


def test_zero_length_sequence_gives_zeros(native: NativeDecode) -> None:
    q, cache, meta, scale = _case([7, 20], 16, 64, torch.float32)
    meta = dataclasses.replace(meta, seq_lens=torch.tensor([0, 20], dtype=torch.int32),
                               seq_lens_host=[0, 20])
    got = native(q, cache, meta, scale)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got[1:], paged_attention(q, cache, meta, scale)[1:],
                               **TOL[torch.float32])


def _with_seq_len(meta, index: int, value: int):
    seq_lens = meta.seq_lens.clone()
    seq_lens[index] = value
    return dataclasses.replace(meta, seq_lens=seq_lens)


def test_length_past_the_block_table_is_refused(native: NativeDecode) -> None:
    q, cache, meta, scale = _case([5, 40], 16, 64, torch.float32)
    width = meta.block_tables.shape[1]                     # 3 columns: 40 tokens of 16
    too_long = _with_seq_len(meta, 1, width * 16 + 1)      # needs one more column
    with pytest.raises(ValueError, match=r"sequence 1 has length 49, needing 4 blocks of 16 "
                                         r"tokens, but the block table has only 3 columns"):
        native(q, cache, too_long, scale)
    native(q, cache, _with_seq_len(meta, 1, width * 16), scale)   # exactly full: accepted


@pytest.mark.parametrize("bad", [-1, "num_blocks", 10 ** 9])
def test_block_id_outside_the_pool_is_refused(native: NativeDecode, bad) -> None:
    q, cache, meta, scale = _case([5, 40], 16, 64, torch.float32)
    bad_id = cache.shape[1] if bad == "num_blocks" else bad
    tables = meta.block_tables.clone()
    tables[1, 2] = bad_id                                  # the partial last block of seq 1
    with pytest.raises(ValueError, match=rf"sequence 1 uses block id {bad_id} \(table column "
                                         rf"2\), outside the pool of {cache.shape[1]} blocks"):
        native(q, cache, dataclasses.replace(meta, block_tables=tables), scale)


def test_one_metadata_object_is_checked_once_and_again_when_a_field_changes(
        native: NativeDecode) -> None:
    """The wrapper checks and converts a step's tables once per metadata object (every layer
    passes the same one); a field given a new tensor is checked again, never read stale."""
    q, cache, meta, scale = _case([5, 40], 16, 64, torch.float32)
    want = paged_attention(q, cache, meta, scale)
    for _ in range(2):   # the second call reuses the checked tables
        torch.testing.assert_close(native(q, cache, meta, scale), want, **TOL[torch.float32])
    meta.seq_lens = meta.seq_lens.clone()
    meta.seq_lens[1] = meta.block_tables.shape[1] * 16 + 1   # past the table
    with pytest.raises(ValueError, match="but the block table has only 3 columns"):
        native(q, cache, meta, scale)
    tables = meta.block_tables.clone()
    tables[1, 2] = cache.shape[1]
    meta.block_tables, meta.seq_lens = tables, _with_seq_len(meta, 1, 40).seq_lens
    with pytest.raises(ValueError, match="outside the pool"):
        native(q, cache, meta, scale)


def test_heads_not_a_multiple_of_kv_heads_are_refused(native: NativeDecode) -> None:
    q, cache, meta, scale = _case([5, 9], 16, 64, torch.float32, num_heads=6, num_kv_heads=4)
    with pytest.raises(ValueError, match="6 query heads are not a multiple of 4 KV heads"):
        native(q, cache, meta, scale)


def test_negative_length_is_refused(native: NativeDecode) -> None:
    q, cache, meta, scale = _case([5, 9], 16, 64, torch.float32)
    with pytest.raises(ValueError, match="sequence 0 has a negative length -3"):
        native(q, cache, _with_seq_len(meta, 0, -3), scale)


def test_shape_mismatches_are_refused_before_the_call(native: NativeDecode) -> None:
    q, cache, meta, scale = _case([5, 9], 16, 64, torch.float32)
    with pytest.raises(ValueError, match="one token per sequence"):
        native(q[:1], cache, meta, scale)
    with pytest.raises(ValueError, match="block table"):
        native(q, cache, dataclasses.replace(meta, block_tables=meta.block_tables[:1]), scale)


def test_failed_scratch_allocation_keeps_the_kernel_usable(native: NativeDecode) -> None:
    """Scratch sized past what can be allocated (2**62 query heads over one KV head): the
    kernel returns PD_ERR_ALLOC before its OpenMP region, and the next call runs normally."""
    q, cache, meta, scale = _case([5, 40], 16, 64, torch.float32)
    run = native._entries[torch.float32].run
    tables = meta.block_tables.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    info = (ctypes.c_int64 * 2)(-1, -1)

    def args(batch: int, heads: int, kv_heads: int) -> DecodeArgs:
        return DecodeArgs(q.data_ptr(), cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                          tables.shape[1], meta.seq_lens.data_ptr(), out.data_ptr(), batch,
                          heads, kv_heads, 64, 16, cache.shape[1], scale, 0,
                          ctypes.addressof(info), 0)
    rc = run(ctypes.byref(args(1, 2 ** 62, 1)))
    assert rc == PD_ERR_ALLOC
    rc = run(ctypes.byref(args(2, NUM_HEADS, NUM_KV_HEADS)))
    assert rc == PD_OK
    torch.testing.assert_close(out, paged_attention(q, cache, meta, scale),
                               **TOL[torch.float32])
    for _ in range(3):    # and the team keeps working through the Python entry point
        torch.testing.assert_close(native(q, cache, meta, scale), out)
