"""The C prefill kernel (native/paged_attention.c, paged_prefill_*) against the reference
paged attention, and its input checks.

Every query token attends causally to its sequence's cached context and the query tokens up
to itself, K/V read in place through shuffled block tables. Head sizes 64 and 128 (compiled
as constants) and 80, 96 (run-time size), block sizes 16 and 32 (and 1, 8, 24: blocks the
16-row score groups do not divide), float32 and bfloat16, fresh prompts and chunks after
cached context, GQA and plain heads, tables padded past what each sequence uses, and garbage
in every slot no sequence owns. Query heads per KV head from 1 to 16 run in tiles of 16 query
rows (prefill_tiles.h; 32 runs each token as a decode), with sliding windows and soft-caps; a
row's result is the same to the bit whichever tile, chunk of its prompt or step it falls in.
Bad query offsets raise a ValueError naming them; the checks shared with the decode (lengths
past the table, block ids outside the pool) hold here too.
"""
from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch
from tessellm_cpu.native_attention import PD_ERR_ALLOC, PD_ERR_QUERY, PD_OK, NativePrefill, PrefillArgs

from tessellm.kernels.examples import (fill_unowned_slots, make_attention_metadata,
                                       pad_block_tables, paged_attention_case)
from tessellm.kernels.reference import paged_attention

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 5e-2}}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def native() -> NativePrefill:
    return NativePrefill()


def _case(query_lens: list[int], seq_lens: list[int], block_size: int, head_dim: int,
          dtype: torch.dtype, num_heads: int = 8, num_kv_heads: int = 2, pad_columns: int = 0,
          seed: int = 0):
    q, cache, meta, scale = paged_attention_case(
        query_lens, seq_lens, 0, block_size, num_heads, num_kv_heads, head_dim, dtype, "cpu",
        torch.Generator().manual_seed(seed))
    return q, cache, pad_block_tables(meta, pad_columns), scale


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128])
def test_prefill_matches_reference(native: NativePrefill, head_dim: int, block_size: int,
                                   dtype: torch.dtype) -> None:
    # fresh prompts (partial last block, exact multiple, one token) and chunks after context
    query_lens = [block_size + 3, 2 * block_size, 1, 7, block_size + 1]
    seq_lens = [block_size + 3, 2 * block_size, 1, 3 * block_size + 2, 2 * block_size + 5]
    q, cache, meta, scale = _case(query_lens, seq_lens, block_size, head_dim, dtype,
                                  pad_columns=2)
    expected = paged_attention(q, cache, meta, scale)
    assert not expected.float().isnan().any()
    got = native(q, cache, meta, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("block_size", [1, 8, 24])
def test_prefill_with_blocks_not_a_multiple_of_16_rows(native: NativePrefill, block_size: int,
                                                       dtype: torch.dtype) -> None:
    query_lens, seq_lens = [3 * block_size + 1, 2, 40], [3 * block_size + 1, 9, 41]
    q, cache, meta, scale = _case(query_lens, seq_lens, block_size, 64, dtype,
                                  num_heads=4, num_kv_heads=4)
    torch.testing.assert_close(native(q, cache, meta, scale),
                               paged_attention(q, cache, meta, scale), **TOL[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (15, 3), (10, 2), (8, 1), (16, 1),
                                            (32, 1)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (21, 0.0), (0, 30.0), (9, 50.0)])
def test_prefill_groups_windows_and_softcaps(native: NativePrefill, heads: int, kv_heads: int,
                                             window: int, softcap: float,
                                             dtype: torch.dtype) -> None:
    """Tiles of 16 // G tokens times G heads (G = 1, 3, 5, 8, 16: tiles of 16, 15, 15, 16 and
    16 rows), and G = 32 (per token), against the reference with a window and a soft-cap."""
    query_lens, seq_lens = [37, 1, 20], [37, 6, 50]
    q, cache, meta, scale = _case(query_lens, seq_lens, 16, 64, dtype, num_heads=heads,
                                  num_kv_heads=kv_heads, seed=heads + window)
    q = q * 3   # scores large enough for the soft-cap to matter
    expected = paged_attention(q, cache, meta, scale, sliding_window=window,
                               logit_softcap=softcap)
    got = native(q, cache, meta, scale, sliding_window=window, logit_softcap=softcap)
    torch.testing.assert_close(got, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
def test_a_row_does_not_depend_on_its_tile(native: NativePrefill, heads: int, kv_heads: int,
                                           dtype: torch.dtype) -> None:
    """A prompt of 45 tokens prefilled at once, and as chunks of 5 + 29 + 11 after the K/V of
    the earlier chunks (a prefix-cache hit or a chunked prefill: every tile boundary moves),
    next to another sequence or alone: each row is the same to the bit."""
    gen = torch.Generator().manual_seed(7)
    meta, num_blocks = make_attention_metadata([45, 30], [45, 30], 16, 0, "cpu", gen)
    cache = torch.randn((2, num_blocks, kv_heads, 16, 64), generator=gen).to(dtype)
    q = torch.randn((75, heads * 64), generator=gen).to(dtype)
    whole = native(q, cache, meta, 0.125)
    start = 0
    for end in (5, 34, 45):
        part = dataclasses.replace(
            meta, num_prefills=1, num_prefill_tokens=end - start,
            slot_mapping=meta.slot_mapping[start:end], block_tables=meta.block_tables[:1],
            seq_lens=torch.tensor([end], dtype=torch.int32),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32),
            query_lens_host=[end - start], seq_lens_host=[end], max_query_len=end - start,
            max_seq_len=end)
        assert torch.equal(native(q[start:end], cache, part, 0.125), whole[start:end])
        start = end


def test_the_step_after_the_decodes_is_its_prefill_part(native: NativePrefill) -> None:
    """A mixed step's prefill part (query rows re-based at 0, as the attention site passes
    them): the same output as the reference over the whole step, prefill rows."""
    gen = torch.Generator().manual_seed(3)
    meta, num_blocks = make_attention_metadata([1, 1, 20, 5], [9, 30, 20, 37], 16, 2, "cpu",
                                               gen)
    cache = torch.randn((2, num_blocks, 2, 16, 64), generator=gen)
    fill_unowned_slots(cache, meta, gen)
    q = torch.randn((27, 8 * 64), generator=gen)
    whole = paged_attention(q, cache, meta, 0.125)
    torch.testing.assert_close(native(q[2:], cache, meta.prefill_part(), 0.125), whole[2:],
                               **TOL[torch.float32])


def test_query_offsets_that_do_not_fit_are_refused(native: NativePrefill) -> None:
    q, cache, meta, scale = _case([5, 9], [5, 12], 16, 64, torch.float32)
    with pytest.raises(ValueError, match="query offsets"):   # more queries than the sequence
        native(q, cache, dataclasses.replace(
            meta, query_start_loc=torch.tensor([0, 1, 14], dtype=torch.int32),
            seq_lens=torch.tensor([5, 12], dtype=torch.int32)), scale)
    with pytest.raises(ValueError, match="query offsets"):   # not ending at the rows of q
        native(q[:13], cache, meta, scale)
    with pytest.raises(ValueError, match="query offsets"):   # falling
        native(q, cache, dataclasses.replace(
            meta, query_start_loc=torch.tensor([0, 9, 5], dtype=torch.int32)), scale)
    with pytest.raises(ValueError, match="query offsets"):   # not starting at 0
        native(q[5:], cache, dataclasses.replace(
            meta, query_start_loc=torch.tensor([5, 5, 14], dtype=torch.int32),
            seq_lens=torch.tensor([5, 9], dtype=torch.int32)), scale)
    with pytest.raises(ValueError, match="3 query offsets"):
        native(q, cache, dataclasses.replace(meta, query_start_loc=meta.query_start_loc[:2]),
               scale)


def test_checks_shared_with_the_decode(native: NativePrefill) -> None:
    q, cache, meta, scale = _case([5, 9], [5, 40], 16, 64, torch.float32)
    seq_lens = meta.seq_lens.clone()
    seq_lens[1] = meta.block_tables.shape[1] * 16 + 1
    with pytest.raises(ValueError, match="native prefill: sequence 1 has length 49, needing 4 "
                                         "blocks of 16 tokens"):
        native(q, cache, dataclasses.replace(meta, seq_lens=seq_lens), scale)
    tables = meta.block_tables.clone()
    tables[1, 2] = cache.shape[1]
    with pytest.raises(ValueError, match=r"uses block id \d+ \(table column 2\), outside"):
        native(q, cache, dataclasses.replace(meta, block_tables=tables), scale)


def test_rows_no_sequence_owns_are_refused(native: NativePrefill) -> None:
    """No sequences but rows of q, the offsets [5] ending at them: every row would be
    without a sequence; the C side refuses before reading any."""
    q, cache, meta, scale = _case([5], [5], 16, 64, torch.float32)
    run = native._entries[torch.float32].run
    tables = meta.block_tables.to(torch.int32).contiguous()
    starts = torch.tensor([5], dtype=torch.int32)
    info = (ctypes.c_int64 * 2)(-1, -1)
    rc = run(ctypes.byref(PrefillArgs(
        q.data_ptr(), cache.data_ptr(), tables.data_ptr(), tables.stride(0), tables.shape[1],
        meta.seq_lens.data_ptr(), starts.data_ptr(), torch.empty_like(q).data_ptr(), 0, 5, 8,
        2, 64, 16, cache.shape[1], scale, 0, ctypes.addressof(info), 0)))
    assert rc == PD_ERR_QUERY


def test_failed_scratch_allocation_keeps_the_kernel_usable(native: NativePrefill) -> None:
    """Scratch sized past what can be allocated (2**62 query heads over one KV head): the
    kernel returns PD_ERR_ALLOC before its OpenMP region, and the next call runs normally."""
    q, cache, meta, scale = _case([5, 9], [5, 40], 16, 64, torch.float32)
    run = native._entries[torch.float32].run
    tables = meta.block_tables.to(torch.int32).contiguous()
    starts = meta.query_start_loc.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    info = (ctypes.c_int64 * 2)(-1, -1)

    def args(heads: int, kv_heads: int) -> PrefillArgs:
        return PrefillArgs(q.data_ptr(), cache.data_ptr(), tables.data_ptr(), tables.stride(0),
                           tables.shape[1], meta.seq_lens.data_ptr(), starts.data_ptr(),
                           out.data_ptr(), 2, q.shape[0], heads, kv_heads, 64, 16,
                           cache.shape[1], scale, 0, ctypes.addressof(info), 0)
    rc = run(ctypes.byref(args(2 ** 62, 1)))
    assert rc == PD_ERR_ALLOC
    rc = run(ctypes.byref(args(8, 2)))
    assert rc == PD_OK
    torch.testing.assert_close(out, paged_attention(q, cache, meta, scale),
                               **TOL[torch.float32])
