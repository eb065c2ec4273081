"""The portable kernels (plain torch for accelerator plugins) against the reference ops on the
CPU, including what static shapes add: padding slots, padding token rows outside every
sequence, empty padding sequences."""
from __future__ import annotations

import pytest
import torch

from tessellm.kernels import portable
from tessellm.kernels import reference as ref
from tessellm.kernels.attention_metadata import metadata_from_tables
from tessellm.kernels.examples import fill_unowned_slots, make_attention_metadata


@pytest.mark.parametrize("slots", [[0, -1, 7, 3, -1], [-1, 5, 0, -1], [-1, -1], [9]])
def test_write_kv_skips_padding_even_next_to_slot_zero(slots) -> None:
    """A padding token must not touch any slot, slot 0 included, whatever its order."""
    g = torch.Generator().manual_seed(len(slots))
    k, v = torch.randn(len(slots), 2 * 8, generator=g), torch.randn(len(slots), 2 * 8, generator=g)
    cache = torch.randn(2, 3, 2, 4, 8, generator=g)
    want = cache.clone()
    ref.write_kv_cache(k, v, want, torch.tensor(slots))
    portable.write_kv_cache(k, v, cache, torch.tensor(slots))
    assert torch.equal(cache, want)


@pytest.mark.parametrize(("query_lens", "seq_lens", "num_decodes"), [
    ([1, 1, 1], [5, 37, 16], 3), ([7, 1, 20], [7, 30, 52], 0), ([12], [12], 0)])
def test_static_attention_matches_reference(query_lens, seq_lens, num_decodes) -> None:
    g = torch.Generator().manual_seed(sum(seq_lens))
    meta, nb = make_attention_metadata(query_lens, seq_lens, 16, num_decodes, "cpu", g)
    cache = torch.randn(2, nb, 2, 16, 8, generator=g)
    fill_unowned_slots(cache, meta, g)
    q = torch.randn(sum(query_lens), 4 * 8, generator=g)
    want = ref.paged_attention(q, cache, meta, 0.35)
    for chunk in (portable.CHUNK_BYTES, 2000):   # one chunk, and several
        got = portable.paged_attention_static(q, cache, meta, 0.35, chunk_bytes=chunk)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_static_attention_padding_rows_and_sequences_give_zeros() -> None:
    """As the runner pads a static-shape step: rows past query_start_loc[-1] belong to no
    sequence, padding sequences have query_len 0 and seq_len 0; real rows are unchanged."""
    g = torch.Generator().manual_seed(0)
    real = metadata_from_tables([3, 1], [3, 9], [[1], [2, 3]], 0, 8)
    padded = metadata_from_tables([3, 1, 0, 0], [3, 9, 0, 0], [[1], [2, 3], [0], [0]], 0, 8)
    cache = torch.randn(2, 4, 2, 8, 8, generator=g)
    cache[:, 0] = 0
    q = torch.randn(8, 4 * 8, generator=g)   # 4 real rows, 4 padding rows
    got = portable.paged_attention_static(q, cache, padded, 0.3)
    torch.testing.assert_close(got[:4], ref.paged_attention(q[:4], cache, real, 0.3),
                               rtol=1e-5, atol=1e-5)
    assert torch.equal(got[4:], torch.zeros(4, 32))


def test_norms_rotary_and_activations_match_reference() -> None:
    g = torch.Generator().manual_seed(1)
    x, r, w = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g), torch.randn(64)
    torch.testing.assert_close(portable.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    for a, b in zip(portable.fused_add_rms_norm(x, r, w, 1e-6), ref.fused_add_rms_norm(x, r, w, 1e-6)):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(portable.silu_and_mul(x), ref.silu_and_mul(x))
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    cs = torch.cat([torch.outer(torch.arange(64).float(), inv).cos(),
                    torch.outer(torch.arange(64).float(), inv).sin()], -1)
    pos = torch.tensor([0, 5, 63])
    q, k = torch.randn(3, 4 * 16, generator=g), torch.randn(3, 2 * 16, generator=g)
    for a, b in zip(portable.rotary_embedding(pos, q, k, cs, 16),
                    ref.rotary_embedding(pos, q, k, cs, 16)):
        torch.testing.assert_close(a, b)
