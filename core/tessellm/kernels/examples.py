"""Example inputs for profiling a kernel at a concrete KernelQuery.

`make_example(query, device)` returns the positional args of the op's reference signature,
shaped as the query says (num_tokens rows, model dims), seeded so every candidate sees the same
values. Attention examples lay sequences out in a paged cache with shuffled block tables.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from tessellm.errors import KernelError
from tessellm.kernels.attention_metadata import AttentionMetadata, metadata_from_tables
from tessellm.kernels.moe_examples import MOE_OPS, moe_example
from tessellm.kernels.registry import KernelQuery
from tessellm.quant.formats import packed_example, packed_format, random_packed

EXAMPLE_BLOCK_SIZE = 16
DECODE_CONTEXT = 128    # context length of each decode sequence in examples
PREFILL_CHUNK = 128     # tokens per prefill sequence in examples
# a query's sliding_window is capped to this in examples, so the window bites within their
# contexts (the kernel gets the window as an argument; the dims only select and bucket)
EXAMPLE_WINDOW_MAX = 40


def _randn(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, dev: str,
           scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).to(dtype=dtype, device=dev)


def make_attention_metadata(query_lens: list[int], seq_lens: list[int], block_size: int,
                            num_decodes: int, dev: str, gen: torch.Generator
                            ) -> tuple[AttentionMetadata, int]:
    """Metadata for sequences with shuffled block tables (block 0 only as padding);
    returns (meta, num_blocks)."""
    blocks_per_seq = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # block 0 is the null block (padding), one spare
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, cursor = [], 0
    for nb in blocks_per_seq:
        tables.append(perm[cursor:cursor + nb])
        cursor += nb
    meta = metadata_from_tables(query_lens, seq_lens, tables, num_decodes, block_size, dev)
    return meta, num_blocks


def fill_unowned_slots(cache: torch.Tensor, meta: AttentionMetadata, gen: torch.Generator) -> None:
    """Put large finite garbage in every slot no sequence owns and zero block 0 (the null
    block), as the engine's cache contract allows: a kernel that reads such slots without
    masking their scores then fails the profiler's reference check."""
    _, num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    used = torch.zeros((num_blocks, block_size), dtype=torch.bool)
    tables = meta.block_tables.cpu()
    for i, seq_len in enumerate(meta.seq_lens_host):
        for p in range(seq_len):
            used[int(tables[i, p // block_size]), p % block_size] = True
    by_slot = cache.transpose(2, 3)                     # [2, blocks, block_size, heads, dim]
    unowned = (~used).to(cache.device)
    n = int(unowned.sum())
    garbage = torch.randn((2, n, num_kv_heads, head_dim), generator=gen) * 1e3
    by_slot[:, unowned] = garbage.to(dtype=cache.dtype, device=cache.device)
    cache[:, 0] = 0


def paged_attention_case(query_lens: list[int], seq_lens: list[int], num_decodes: int,
                         block_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype, dev: str, gen: torch.Generator) -> list[Any]:
    """[q, kv_cache, meta, scale] for paged attention over shuffled block tables, garbage in
    every slot no sequence owns (fill_unowned_slots)."""
    meta, nblocks = make_attention_metadata(query_lens, seq_lens, block_size, num_decodes, dev,
                                            gen)
    cache = _randn(gen, (2, nblocks, num_kv_heads, block_size, head_dim), dtype, dev)
    fill_unowned_slots(cache, meta, gen)
    return [_randn(gen, (sum(query_lens), num_heads * head_dim), dtype, dev), cache, meta,
            1.0 / math.sqrt(head_dim)]


def pad_block_tables(meta: AttentionMetadata, columns: int) -> AttentionMetadata:
    """meta with `columns` more block-table columns no sequence uses, holding an id far
    outside any pool (a kernel that reads past a sequence's blocks then fails loudly)."""
    if not columns:
        return meta
    tables = meta.block_tables
    pad = torch.full((tables.shape[0], columns), 10 ** 9, dtype=tables.dtype,
                     device=tables.device)
    return dataclasses.replace(meta, block_tables=torch.cat((tables, pad), 1))


def _attention_example(query: KernelQuery, dev: str, gen: torch.Generator) -> list[Any]:
    T = query.num_tokens
    if query.op == "attention_decode":
        qlens, slens, nd = [1] * T, [DECODE_CONTEXT] * T, T
    else:
        qlens = [PREFILL_CHUNK] * (T // PREFILL_CHUNK) + ([T % PREFILL_CHUNK] if T % PREFILL_CHUNK else [])
        # the second sequence (if any) has cached context before its chunk
        slens = [q + (32 if i == 1 else 0) for i, q in enumerate(qlens)]
        nd = 0
    args = paged_attention_case(qlens, slens, nd, EXAMPLE_BLOCK_SIZE, query.dim("num_heads"),
                                query.dim("num_kv_heads"), query.dim("head_dim"), query.dtype,
                                dev, gen)
    return args + attention_feature_args(query)


def attention_feature_args(query: KernelQuery) -> list[Any]:
    """[sliding_window, logit_softcap] for an attention query whose dims have either (the
    window capped at EXAMPLE_WINDOW_MAX, the cap from its thousandths), [] otherwise."""
    d = dict(query.dims)
    if "sliding_window" not in d and "logit_softcap" not in d:
        return []
    return [min(d.get("sliding_window", 0), EXAMPLE_WINDOW_MAX),
            d.get("logit_softcap", 0) / 1000.0]


def _sample_example(T: int, vocab: int, dev: str, gen: torch.Generator) -> list[Any]:
    """Rows of distinct logits (a shuffled ramp over [-6, 6): no ties, so the winner does not
    hang on tie order) and per-row params cycling top_k / top_p / min_p on and off, with
    temperatures in [0.5, 1.5]; Exponential(1) noise clamped to float32's tiny."""
    ramp = torch.arange(vocab, dtype=torch.float32) * (12.0 / vocab) - 6.0
    logits = torch.stack([ramp[torch.randperm(vocab, generator=gen)] for _ in range(T)])
    rows = torch.arange(T)
    temperature = 0.5 + (rows % 5).float() * 0.25
    # row 0 (a bucket of one row) uses every filter; later rows cycle each on and off
    top_k = torch.where(rows % 2 == 0, max(1, min(vocab - 1, 40)), vocab).long()
    top_p = torch.where(rows % 3 == 0, 0.9, float("inf")).float()
    top_p = torch.where(rows % 3 == 2, 0.5, top_p)
    min_p = torch.where(rows % 4 < 2, 0.05, 0.0).float()
    noise = torch.empty((T, vocab), dtype=torch.float32).exponential_(generator=gen)
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return [t.to(dev) for t in (logits, temperature, top_k, top_p, min_p, noise)]


def _greedy_example(T: int, vocab: int, dt: torch.dtype, dev: str,
                    gen: torch.Generator) -> list[Any]:
    """Random logits in the query's dtype where the order rules matter: row 0 holds its
    largest value twice (the lower index must win), row 1 a NaN behind its largest value
    (the NaN must win), row 2 two NaNs (the first wins); later rows are plain."""
    x = torch.randn((T, vocab), generator=gen).to(dt)
    cols = torch.randperm(vocab, generator=gen)[:2].sort().values.tolist()
    lo, hi = cols if len(cols) == 2 else (0, 0)
    x[0, lo] = x[0, hi] = 8.0
    if T > 1:
        x[1, lo], x[1, hi] = 8.0, float("nan")
    if T > 2:
        x[2, lo] = x[2, hi] = float("nan")
    return [x.to(dev)]


def bitmask_example(T: int, vocab: int, dt: torch.dtype, dev: str,
                    gen: torch.Generator) -> list[Any]:
    """[logits, bitmask] where the layout matters: row 0 allows every token (all-ones words),
    row 1 none, row 2 only the first and the last token, later rows random bits (words of
    -1 and 0 mixed in); the last word's bits past `vocab` are set (they must be ignored)."""
    words = (vocab + 31) // 32
    x = torch.randn((T, vocab), generator=gen).to(dt)
    bits = torch.randint(-2 ** 31, 2 ** 31, (T, words), generator=gen, dtype=torch.int64)
    mask = bits.to(torch.int32)
    if T > 3:
        mask[3:, ::3] = -1
        mask[3:, 1::5] = 0
    mask[0] = -1
    if T > 1:
        mask[1] = 0
    if T > 2:
        mask[2] = 0
        mask[2, 0] = 1
        last = vocab - 1
        mask[2, last // 32] |= torch.tensor(1 << (last % 32), dtype=torch.int64).to(
            torch.int32)
    if vocab % 32:   # bits past the vocabulary, set in every row
        mask[:, -1] |= torch.tensor(-(1 << (vocab % 32)), dtype=torch.int32)
    return [x.to(dev), mask.to(dev)]


def make_example(query: KernelQuery, dev: str,
                 weights: dict[tuple[Any, ...], Any] | None = None) -> list[Any]:
    """`weights`: a memo the caller owns, so that the packed weight of one shape is made once
    for all token buckets (an embedding table is tens of MB; made per bucket it was most of a
    cold start's profiling time)."""
    gen = torch.Generator().manual_seed(1234)
    T, dt, op = query.num_tokens, query.dtype, query.op
    d = dict(query.dims)
    memo = weights if weights is not None else {}
    if op == "embedding":
        return [torch.randint(0, d["vocab"], (T,), generator=gen).to(dev),
                _randn(gen, (d["vocab"], d["hidden"]), dt, dev)]
    if op == "linear":
        w = _randn(gen, (d["out_features"], d["in_features"]), dt, dev, d["in_features"] ** -0.5)
        b = _randn(gen, (d["out_features"],), dt, dev) if d["bias"] else None
        return [_randn(gen, (T, d["in_features"]), dt, dev), w, b]
    if op in ("linear_packed", "linear_packed_q8act"):  # weights quantized from seeded ones
        key = ("linear_packed", d["qtype"], d["out_features"], d["in_features"], dt, dev)
        if key not in memo:
            w = packed_example(packed_format(d["qtype"]), d["out_features"], d["in_features"],
                               gen, scale=d["in_features"] ** -0.5, compute_dtype=dt)
            memo[key] = w.with_data(w.data.to(dev))
        b = _randn(gen, (d["out_features"],), dt, dev) if d["bias"] else None
        return [_randn(gen, (T, d["in_features"]), dt, dev), memo[key], b]
    if op == "embedding_packed":   # valid random blocks: a gather reads them, whatever they hold
        key = ("embedding_packed", d["qtype"], d["vocab"], d["hidden"], dt, dev)
        if key not in memo:
            w = random_packed(packed_format(d["qtype"]), d["vocab"], d["hidden"], gen,
                              scale=1.0, compute_dtype=dt)
            memo[key] = w.with_data(w.data.to(dev))
        return [torch.randint(0, d["vocab"], (T,), generator=gen).to(dev), memo[key]]
    if op == "rms_norm":  # the last row is zero: a kernel that ignores eps yields NaN there
        if "heads" in d:  # per-head norm (qwen3's q/k): a [T, heads, D] view of wider rows
            wide = _randn(gen, (T, (d["heads"] + 1) * d["hidden"]), dt, dev)
            x = wide[:, :d["heads"] * d["hidden"]].unflatten(-1, (d["heads"], d["hidden"]))
        else:
            x = _randn(gen, (T, d["hidden"]), dt, dev)
        x[-1] = 0
        return [x, _randn(gen, (d["hidden"],), dt, dev), 1e-6]
    if op == "fused_add_rms_norm":
        h = d["hidden"]
        x, residual = _randn(gen, (T, h), dt, dev), _randn(gen, (T, h), dt, dev)
        x[-1], residual[-1] = 0, 0
        return [x, residual, _randn(gen, (h,), dt, dev), 1e-6]
    if op == "layer_norm":
        h = d["hidden"]
        return [_randn(gen, (T, h), dt, dev), _randn(gen, (h,), dt, dev),
                _randn(gen, (h,), dt, dev), 1e-5]
    if op in ("add", "mul"):
        return [_randn(gen, (T, d["features"]), dt, dev), _randn(gen, (T, d["features"]), dt, dev)]
    if op in ("silu", "gelu_tanh"):
        return [_randn(gen, (T, d["features"]), dt, dev)]
    if op == "silu_and_mul":
        return [_randn(gen, (T, 2 * d["features"]), dt, dev)]
    if op == "mul_scalar":   # Gemma's sqrt(hidden) of a hidden that is no square
        return [_randn(gen, (T, d["features"]), dt, dev), math.sqrt(3072)]
    if op == "logit_softcap":   # values well past the cap as well as inside it
        return [_randn(gen, (T, d["features"]), dt, dev, 8.0), 5.0]
    if op == "rotary_embedding":
        nh, nkv, hd = d["num_heads"], d["num_kv_heads"], d["head_dim"]
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        f = torch.outer(torch.arange(4096).float(), inv)
        cos_sin = torch.cat((f.cos(), f.sin()), -1).to(dev)
        pos = torch.randint(0, 4096, (T,), generator=gen).to(dev)
        return [pos, _randn(gen, (T, nh * hd), dt, dev), _randn(gen, (T, nkv * hd), dt, dev),
                cos_sin, hd]
    if op == "write_kv_cache":
        nkv, hd = d["num_kv_heads"], d["head_dim"]
        nblocks = math.ceil(T / EXAMPLE_BLOCK_SIZE) * 2
        slots = torch.randperm(nblocks * EXAMPLE_BLOCK_SIZE, generator=gen)[:T]
        if T >= 2:   # a padding token: a kernel that writes it changes the prior cache contents
            slots[-1] = -1
        return [_randn(gen, (T, nkv * hd), dt, dev), _randn(gen, (T, nkv * hd), dt, dev),
                _randn(gen, (2, nblocks, nkv, EXAMPLE_BLOCK_SIZE, hd), dt, dev), slots.to(dev)]
    if op in ("attention_decode", "attention_prefill"):
        return _attention_example(query, dev, gen)
    if op == "sample_tokens":
        return _sample_example(T, d["vocab"], dev, gen)
    if op == "greedy_tokens":
        return _greedy_example(T, d["vocab"], dt, dev, gen)
    if op == "apply_token_bitmask":
        return bitmask_example(T, d["vocab"], dt, dev, gen)
    if op in MOE_OPS:
        return moe_example(query, dev, gen, memo)
    if op == "lora_add":   # every slot present, and base-model rows (-1)
        S, R, i, o = d["slots"], d["rank"], d["in_features"], d["out_features"]
        slots = torch.randint(-1, S, (T,), generator=gen)
        return [_randn(gen, (T, i), dt, dev), _randn(gen, (T, o), dt, dev),
                _randn(gen, (S, R, i), dt, dev, i ** -0.5),
                _randn(gen, (S, R, o), dt, dev, R ** -0.5), slots.to(dev)]
    raise KernelError(f"no example inputs defined for op {op!r}")


# Ops that write into an argument instead of returning a result: op -> index of that argument.
IN_PLACE_OUTPUT_ARG = {"write_kv_cache": 2, "apply_token_bitmask": 0}
