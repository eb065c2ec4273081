"""The weight splits of tensor parallelism (tessellm.models.sharding), checked on their own:
packed (GGUF) weights split by rows and by whole blocks of columns equal the same slices of
the dequantized weight, a vocabulary that does not divide is padded with rows that read as
zero, and what cannot be split is a clear error."""
from __future__ import annotations

import pytest
import torch

from tessellm.errors import ConfigError
from tessellm.models.sharding import Shard, _columns, _rows, _vocab_rows, check_shardable
from tessellm.models.spec import ModelSpec
from tessellm.quant.formats import PACKED_FORMATS, dequantize, packed_example, quantize


def _spec(**kw) -> ModelSpec:
    base = dict(architecture="LlamaForCausalLM", vocab_size=101, hidden_size=128, num_layers=1,
                num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256, norm_eps=1e-5,
                max_position_embeddings=64, tie_word_embeddings=False)
    return ModelSpec(**{**base, **kw})


@pytest.mark.parametrize("fmt", list(PACKED_FORMATS.values()), ids=lambda f: f.name)
def test_packed_splits_equal_slices_of_the_dequantized_weight(fmt):
    k = 4 * fmt.block_weights          # K-quants split at super-blocks of 256
    packed = packed_example(fmt, 48, k, torch.Generator().manual_seed(0))
    full = dequantize(packed, torch.float32)
    torch.testing.assert_close(dequantize(_rows(packed, 16, 40), torch.float32), full[16:40])
    cols = _columns(packed, k // 2, k, "down_proj")
    assert cols.in_features == k // 2
    torch.testing.assert_close(dequantize(cols, torch.float32), full[:, k // 2:])
    if fmt.block_weights > 32:
        with pytest.raises(ConfigError, match="blocks of 256"):
            _columns(packed, 0, 32, "down_proj")


def test_a_packed_split_inside_a_block_is_refused():
    packed = quantize(torch.randn(8, 96), next(iter(PACKED_FORMATS.values())))
    with pytest.raises(ConfigError, match="cuts a block"):
        _columns(packed, 0, 48, "o_proj")


@pytest.mark.parametrize("rank", [0, 1])
def test_an_uneven_vocabulary_is_padded_with_zero_rows(rank):
    spec = _spec()   # 101 rows over 2 ranks: 51 each, the last rank one padding row
    w = torch.randn(101, 8)
    part = _vocab_rows(w, Shard(rank, 2, spec))
    assert part.shape == (51, 8)
    held = w[rank * 51:(rank + 1) * 51]
    torch.testing.assert_close(part[:held.shape[0]], held)
    assert not part[held.shape[0]:].any()
    packed = quantize(torch.randn(101, 32), next(iter(PACKED_FORMATS.values())))
    padded = dequantize(_vocab_rows(packed, Shard(rank, 2, spec)), torch.float32)
    assert padded.shape == (51, 32) and not padded[held.shape[0]:].any()


def test_kv_heads_fewer_than_ranks_are_replicated_per_query_group():
    spec = _spec(num_heads=8, num_kv_heads=2)   # 4 ranks: 2 query heads each, 1 KV head copy
    starts = [Shard(r, 4, spec).kv_head_start for r in range(4)]
    assert starts == [0, 0, 1, 1] and Shard(0, 4, spec).kv_heads == 1


@pytest.mark.parametrize("kw, world, what", [
    (dict(num_heads=6, num_kv_heads=6), 4, "attention heads"),
    (dict(num_heads=12, num_kv_heads=3), 2, "KV heads"),
    (dict(intermediate_size=250), 4, "intermediate size"),
])
def test_what_the_ranks_cannot_split_is_named(kw, world, what):
    with pytest.raises(ConfigError, match=what):
        check_shardable(_spec(**kw), world)
