"""Every kernel of the CPU plugin equals its reference op.

On the profiler's own example inputs (tessellm.kernels.examples) for float32 (tight) and
bfloat16 (loose), at token counts that are and are not powers of two; then attention on
hand-made batches: GQA (8 query heads over 2 KV heads), mixed-length prefills over cached
context, decodes of different lengths, small and large blocks.
"""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from tessellm_cpu.kernels import cpu_kernels

from tessellm.kernels.examples import IN_PLACE_OUTPUT_ARG, make_attention_metadata, make_example
from tessellm.kernels.profiler import ROUNDED_INTERMEDIATE_ATOL
from tessellm.kernels.reference import REFERENCE_OPS
from tessellm.kernels.registry import Kernel, KernelQuery

KERNELS = cpu_kernels("cpu")
ATTN = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 16}
DIMS: dict[str, list[dict[str, int]]] = {
    "embedding": [{"vocab": 100, "hidden": 64}],
    "linear": [{"in_features": 64, "out_features": 48, "bias": 0},
               {"in_features": 64, "out_features": 48, "bias": 1},
               {"in_features": 64, "out_features": 96, "bias": 0},   # AMX tiles: 32 | N, K
               {"in_features": 64, "out_features": 96, "bias": 1}],
    "linear_packed": [{"in_features": 96, "out_features": 37, "bias": b, "qtype": q}
                      for q in (2, 3, 8) for b in (0, 1)],
    "linear_packed_q8act": [{"in_features": 96, "out_features": 37, "bias": b, "qtype": q}
                            for q in (2, 3, 8) for b in (0, 1)],
    "embedding_packed": [{"vocab": 100, "hidden": 64, "qtype": q} for q in (2, 3, 8)],
    "rms_norm": [{"hidden": 64}],
    "fused_add_rms_norm": [{"hidden": 64}],
    "layer_norm": [{"hidden": 64}],
    "add": [{"features": 96}], "mul": [{"features": 96}], "silu": [{"features": 96}],
    "silu_and_mul": [{"features": 96}], "gelu_tanh": [{"features": 96}],
    "rotary_embedding": [ATTN],
    "write_kv_cache": [{"num_kv_heads": 2, "head_dim": 16}],
    "mul_scalar": [{"features": 96}], "logit_softcap": [{"features": 96}],
    # a sliding window (the examples cap it at 40 keys, inside their contexts), a soft-cap of
    # 2.5 (in thousandths), both
    "attention_decode": [ATTN, {**ATTN, "sliding_window": 4096}, {**ATTN, "logit_softcap": 2500},
                         {**ATTN, "sliding_window": 20, "logit_softcap": 2500}],
    "attention_prefill": [ATTN, {**ATTN, "sliding_window": 4096},
                          {**ATTN, "logit_softcap": 2500},
                          {**ATTN, "sliding_window": 20, "logit_softcap": 2500}],
    "greedy_tokens": [{"vocab": 1000}, {"vocab": 5003}],
    "apply_token_bitmask": [{"vocab": 1000}, {"vocab": 5003}, {"vocab": 64}],
    "moe_router": [{"experts": 8, "top_k": 2, "renormalize": r, "sigmoid": s}
                   for r in (0, 1) for s in (0, 1)],
    "fused_moe": [{"hidden": 64, "features": 32, "experts": 4, "top_k": 2}],
    "fused_moe_packed": [{"hidden": 64, "features": 32, "experts": 4, "top_k": 2, "qtype": q,
                          "qtype_down": q} for q in (2, 3, 8)],
    "fused_moe_packed_q8act": [{"hidden": 64, "features": 32, "experts": 4, "top_k": 2,
                                "qtype": q, "qtype_down": q} for q in (2, 3, 8)],
    "sigmoid_gate": [{"hidden": 64}],
    "lora_add": [{"in_features": 64, "out_features": 96, "slots": 4, "rank": 16},
                 {"in_features": 96, "out_features": 37, "slots": 1, "rank": 24}],
}
TOKENS = [1, 3, 17, 130]
# kernels offered only for some calls: what each claims (checked both ways below)
NARROW = {**{name: lambda dtype, d, tokens: dtype is torch.bfloat16
             and d["in_features"] % 32 == 0 and d["out_features"] % 32 == 0
             for name in ("linear_amx_native", "linear_bf16dot_native")},   # pair tiles
          "linear_q8act_amx": lambda dtype, d, tokens: tokens >= 16,   # tiles of 16 rows
          "linear_packed_amx": lambda dtype, d, tokens: tokens >= 16,
          "linear_f32_native": lambda dtype, d, tokens: dtype is torch.float32 and tokens <= 16,
          # SDPA cannot soft-cap its scores
          **{name: lambda dtype, d, tokens: "logit_softcap" not in d
             for name in ("decode_batched_sdpa", "decode_per_seq_sdpa", "prefill_per_seq_sdpa",
                          "prefill_batched_sdpa")}}
TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5},
       torch.bfloat16: {"rtol": 1.6e-2, "atol": 5e-2}}
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _outputs(op: str, args: list[Any], result: Any) -> list[torch.Tensor]:
    if op in IN_PLACE_OUTPUT_ARG:
        return [args[IN_PLACE_OUTPUT_ARG[op]]]
    return list(result) if isinstance(result, tuple) else [result]


def _clone(args: list[Any]) -> list[Any]:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _identical(x: Any, y: Any) -> bool:
    """Same tensor contents, NaN matching NaN (example caches hold NaN in unwritten slots)."""
    if not isinstance(x, torch.Tensor) or x.is_mkldnn:
        return x is y
    if not x.is_floating_point():
        return torch.equal(x, y)
    return torch.equal(x.isnan(), y.isnan()) and torch.equal(x.nan_to_num(), y.nan_to_num())


def _cases() -> list[Any]:
    cases = []
    for k in KERNELS:
        for dims in DIMS[k.op]:
            suffix = f"-bias{dims['bias']}" if k.op.startswith("linear") else ""
            suffix += f"-q{dims['qtype']}" if "qtype" in dims else ""
            suffix += f"-w{dims['sliding_window']}" if "sliding_window" in dims else ""
            suffix += f"-cap{dims['logit_softcap']}" if "logit_softcap" in dims else ""
            cases.append(pytest.param(k, tuple(sorted(dims.items())), id=f"{k.name}{suffix}"))
    return cases


def test_every_cpu_kernel_op_is_covered() -> None:
    assert {k.op for k in KERNELS} <= set(DIMS) <= set(REFERENCE_OPS)
    assert all(k.device == "cpu" for k in KERNELS)
    assert len({(k.op, k.name) for k in KERNELS}) == len(KERNELS)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize(("kernel", "dims"), _cases())
def test_kernel_matches_reference_on_examples(kernel: Kernel, dims: tuple, num_tokens: int,
                                              dtype: torch.dtype) -> None:
    query = KernelQuery(kernel.op, dtype, num_tokens, dims)
    if kernel.name in NARROW and not NARROW[kernel.name](dtype, dict(dims), num_tokens):
        assert not kernel.supports(query)
        return
    assert kernel.supports(query)
    args = make_example(query, "cpu")
    ref_args, run_args = _clone(args), _clone(args)
    expected = _outputs(kernel.op, ref_args, REFERENCE_OPS[kernel.op](*ref_args))
    if kernel.weight_layout is not None:  # the kernel reads its weight in its own layout
        run_args[1] = kernel.weight_layout.prepare(run_args[1])
        args[1] = run_args[1]
    got = _outputs(kernel.op, run_args, kernel.fn(*run_args))
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype
        atol = max(TOL[dtype]["atol"], ROUNDED_INTERMEDIATE_ATOL.get(kernel.op, 0.0))
        torch.testing.assert_close(g, e, rtol=TOL[dtype]["rtol"], atol=atol)
    # inputs are read, never written (except the in-place op's output argument)
    out_arg = IN_PLACE_OUTPUT_ARG.get(kernel.op)
    keep = [i for i in range(len(args)) if i != out_arg]
    assert all(_identical(run_args[i], args[i]) for i in keep)


# ------------------------------------------------------------------ attention batches

def _attention_case(query_lens: list[int], seq_lens: list[int], num_decodes: int,
                    block_size: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    meta, num_blocks = make_attention_metadata(query_lens, seq_lens, block_size, num_decodes,
                                               "cpu", gen)
    nh, nkv, hd = ATTN["num_heads"], ATTN["num_kv_heads"], ATTN["head_dim"]
    cache = torch.randn((2, num_blocks, nkv, block_size, hd), generator=gen).to(dtype)
    q = torch.randn((sum(query_lens), nh * hd), generator=gen).to(dtype)
    return q, cache, meta, 1.0 / math.sqrt(hd)


def _garbage_in_unowned_slots(cache: torch.Tensor, meta) -> torch.Tensor:
    """Huge finite values everywhere except the slots holding each sequence's K/V and the null
    block 0 (zero): what the engine's cache contract allows the pool to hold."""
    garbage = torch.full_like(cache, 3e4)
    garbage[:, 0] = 0
    bs = meta.block_size
    for i, seq_len in enumerate(meta.seq_lens_host):
        for p in range(seq_len):
            b = int(meta.block_tables[i, p // bs])
            garbage[:, b, :, p % bs] = cache[:, b, :, p % bs]
    return garbage


def _attention_kernels(op: str) -> list[Any]:
    return [pytest.param(k, id=k.name) for k in KERNELS if k.op == op]


PREFILL_BATCHES = {
    # fresh prompts of different lengths, chunks over cached context, a 1-token chunk
    "mixed": ([5, 17, 1, 9, 33], [5, 40, 23, 9, 49]),
    "one_long_with_context": ([70], [101]),
    "all_fresh": ([3, 16, 4], [3, 16, 4]),
}
DECODE_BATCHES = {
    "mixed": [1, 7, 16, 17, 50, 3],
    "one": [33],
    "block_edges": [4, 5, 8, 16, 64],
}


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("batch", list(PREFILL_BATCHES))
@pytest.mark.parametrize("kernel", _attention_kernels("attention_prefill"))
def test_prefill_attention_batches(kernel: Kernel, batch: str, block_size: int,
                                   dtype: torch.dtype) -> None:
    qlens, slens = PREFILL_BATCHES[batch]
    q, cache, meta, scale = _attention_case(qlens, slens, 0, block_size, dtype)
    expected = REFERENCE_OPS["attention_prefill"](q, cache, meta, scale)
    torch.testing.assert_close(kernel.fn(q, cache, meta, scale), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("batch", list(DECODE_BATCHES))
@pytest.mark.parametrize("kernel", _attention_kernels("attention_decode"))
def test_decode_attention_batches(kernel: Kernel, batch: str, block_size: int,
                                  dtype: torch.dtype) -> None:
    slens = DECODE_BATCHES[batch]
    q, cache, meta, scale = _attention_case([1] * len(slens), slens, len(slens), block_size, dtype)
    expected = REFERENCE_OPS["attention_decode"](q, cache, meta, scale)
    torch.testing.assert_close(kernel.fn(q, cache, meta, scale), expected, **TOL[dtype])


# Speculative verify rows: a sequence's rows at lengths L, L + 1, .. over one block table
# (the native decode reads such a group's blocks once for all its rows, at most 8 rows a
# group): a group of 5, a lone row, a group crossing a block edge, 10 rows (8 + 2), and a
# row continuing a length but with another table (not a group).
VERIFY_GROUPS = [[30, 31, 32, 33, 34], [7], [15, 16, 17], list(range(40, 50)), [50], [8, 9]]


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kernel", _attention_kernels("attention_decode"))
def test_decode_attention_verify_rows_sharing_a_table(kernel: Kernel, block_size: int,
                                                      dtype: torch.dtype) -> None:
    slens = [n for group in VERIFY_GROUPS for n in group]
    q, cache, meta, scale = _attention_case([1] * len(slens), slens, len(slens), block_size, dtype)
    row = 0
    for g, group in enumerate(VERIFY_GROUPS):
        last = row + len(group) - 1
        shared = g != len(VERIFY_GROUPS) - 1    # the last group keeps its own tables
        for i in range(row, last + 1 if shared else row):
            meta.block_tables[i].copy_(meta.block_tables[last])
        row = last + 1
    expected = REFERENCE_OPS["attention_decode"](q, cache, meta, scale)
    torch.testing.assert_close(kernel.fn(q, cache, meta, scale), expected, **TOL[dtype])
    # each row's output is what it gets alone (the grouping changes no result)
    alone = kernel.fn(q[2:3], cache, _row_meta(meta, 2), scale)
    torch.testing.assert_close(kernel.fn(q, cache, meta, scale)[2:3], alone, **TOL[dtype])


def _row_meta(meta, i: int):
    from tessellm.kernels.examples import metadata_from_tables
    bs = meta.block_size
    n = math.ceil(meta.seq_lens_host[i] / bs)
    return metadata_from_tables([1], [meta.seq_lens_host[i]], [meta.block_tables[i, :n].tolist()],
                                1, bs, "cpu")


@pytest.mark.parametrize("kernel", [pytest.param(k, id=k.name) for k in KERNELS
                                    if k.op in ("attention_decode", "attention_prefill")])
def test_attention_reads_only_the_sequences_slots(kernel: Kernel) -> None:
    """Slots no sequence owns hold stale (finite) data: kernels must mask their scores, so the
    garbage never reaches the output (AttentionMetadata's cache contract)."""
    if kernel.op == "attention_decode":
        slens = DECODE_BATCHES["mixed"]
        q, cache, meta, scale = _attention_case([1] * len(slens), slens, len(slens), 4,
                                                torch.float32)
    else:
        qlens, slens = PREFILL_BATCHES["mixed"]
        q, cache, meta, scale = _attention_case(qlens, slens, 0, 4, torch.float32)
    cache = _garbage_in_unowned_slots(cache, meta)
    expected = REFERENCE_OPS[kernel.op](q, cache, meta, scale)
    assert not expected.isnan().any()
    torch.testing.assert_close(kernel.fn(q, cache, meta, scale), expected, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_mixed_step_split_into_decode_and_prefill_parts(dtype: torch.dtype) -> None:
    """What the lowering's AttentionSite does: decodes first, then prefills, each on its part."""
    qlens, slens = [1, 1, 1, 6, 20], [9, 30, 2, 6, 37]
    q, cache, meta, scale = _attention_case(qlens, slens, 3, 4, dtype, seed=3)
    expected = REFERENCE_OPS["attention_prefill"](q, cache, meta, scale)
    nd = meta.num_decode_tokens
    for dec in (k for k in KERNELS if k.op == "attention_decode"):
        for pre in (k for k in KERNELS if k.op == "attention_prefill"):
            got = torch.cat((dec.fn(q[:nd], cache, meta.decode_part(), scale),
                             pre.fn(q[nd:], cache, meta.prefill_part(), scale)))
            torch.testing.assert_close(got, expected, **TOL[dtype])
