"""The Triton fused_moe (tessellm_cuda.triton_ops.moe) against reference_moe.fused_moe, through
Triton's interpreter on CPU tensors: token counts 1 to 300 (one to five 128-pair chunks of the
alignment kernels, every block size 16 / 32 / 64), skewed routing (one expert takes every
token, the last none: moe_examples.skewed_routing), every token choosing the same experts,
widths that are not multiples of the tiles, strided x, more experts than one count tile, and
an empty step; the alignment's layout itself (each pair once, in its expert's blocks, in pair
order; padding per expert; block owners; the padded total).

Tolerance: float32 as test_moe_kernels' (both sides sum the same float32 products in another
order, then the k-sum in another order); 16-bit: the profiler's. Under the interpreter the
16-bit dots run in float32 (attention.py's rule), the GPU's tensor-core path is not covered.
"""
from __future__ import annotations

import pytest
import torch

from tessellm.kernels.moe_examples import skewed_routing
from tessellm.kernels.profiler import TOLERANCES
from tessellm.kernels.reference_moe import fused_moe as reference
from tessellm_cuda.kernels import cuda_kernels, interpreter_kernels
from tessellm_cuda.triton_ops import moe
from tessellm_cuda.triton_ops.launch import run_all

H, I, E, K = 64, 32, 6, 2
TOKEN_COUNTS = [1, 2, 3, 7, 16, 33, 64, 129, 300]


def _weights(g: torch.Generator, dtype: torch.dtype, hidden: int = H, inter: int = I,
             experts: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = torch.randn((experts * 2 * inter, hidden), generator=g) * hidden ** -0.5
    w2 = torch.randn((experts * hidden, inter), generator=g) * inter ** -0.5
    return w13.to(dtype), w2.to(dtype)


def _routings(T: int, g: torch.Generator, experts: int = E, k: int = K):
    yield "skewed", skewed_routing(T, experts, k, g)
    same = torch.tensor([[experts - 1, 2]]).repeat(T, 1)   # every token: the same two experts
    yield "same", (torch.full((T, k), 0.5), same)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    if dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5}
    rtol, atol = TOLERANCES[dtype]
    return {"rtol": rtol, "atol": atol}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_triton_fused_moe_equals_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    w13, w2 = _weights(g, dtype)
    for T in TOKEN_COUNTS:
        x = torch.randn((T, H), generator=g).to(dtype)
        for label, (weights, ids) in _routings(T, g):
            got = moe.fused_moe(x, w13, w2, weights, ids)
            assert got.shape == (T, H) and got.dtype == dtype, (T, label)
            torch.testing.assert_close(got, reference(x, w13, w2, weights, ids), **_tol(dtype),
                                       msg=lambda m: f"T={T} {label}: {m}")


def test_fp16_odd_widths_strided_x_and_many_experts() -> None:
    """H, I off the 64-feature and 64-wide K tiles (masks), x a column slice of a wider
    tensor, 40 experts (two count tiles of 32, E_PAD 64) with top_k 3."""
    g = torch.Generator().manual_seed(12)
    hidden, inter, experts, k = 40, 24, 40, 3
    w13, w2 = _weights(g, torch.float16, hidden, inter, experts)
    for T in (5, 130):
        x = torch.randn((T, hidden + 8), generator=g).half()[:, 4:4 + hidden]
        weights, ids = skewed_routing(T, experts, k, g)
        torch.testing.assert_close(moe.fused_moe(x, w13, w2, weights, ids),
                                   reference(x, w13, w2, weights, ids), **_tol(torch.float16))
    w13, w2 = _weights(g, torch.float32, hidden, inter, experts)
    x = torch.randn((70, hidden), generator=g)
    weights, ids = skewed_routing(70, experts, k, g)
    torch.testing.assert_close(moe.fused_moe(x, w13, w2, weights, ids),
                               reference(x, w13, w2, weights, ids), **_tol(torch.float32))


@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("routing", ["skewed", "same"])
def test_alignment_layout(T: int, routing: str) -> None:
    g = torch.Generator().manual_seed(T)
    ids = dict(_routings(T, g))[routing][1]
    P = ids.numel()
    block_m = moe.block_m_for(P, E)
    sorted_ids, expert_ids, post_pad, launches = moe.align_launches(ids, E, block_m)
    run_all(launches)
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=E)
    padded = (counts + block_m - 1) // block_m * block_m
    total = int(post_pad.item())
    assert total == int(padded.sum())
    assert sorted_ids.numel() >= total and sorted_ids.numel() % block_m == 0
    rows = sorted_ids[:total].long()
    owners = expert_ids[:total // block_m].long().repeat_interleave(block_m)
    start = 0
    for e in range(E):   # expert e's rows: its pairs in pair order, then padding
        mine = rows[start:start + int(padded[e])]
        want = torch.nonzero(flat == e).flatten()
        assert torch.equal(mine[:len(want)], want), e
        assert (mine[len(want):] == P).all(), e
        assert (owners[start:start + int(padded[e])] == e).all(), e
        start += int(padded[e])
    assert (sorted_ids[total:] == P).all()
    assert (expert_ids[total // block_m:] == -1).all()


def test_block_size_and_bound() -> None:
    assert moe.block_m_for(2, 8) == 16 and moe.block_m_for(8 * 40, 8) == 32
    assert moe.block_m_for(8 * 100, 8) == 64
    # an expert nobody chose takes no rows: a decode step's buffers follow its pairs
    assert moe.padded_rows(8, 128, 16) == 8 + 8 * 15
    assert moe.padded_rows(4096, 8, 64) == 4096 + 8 * 63


def test_empty_step_and_wrong_dtype() -> None:
    g = torch.Generator().manual_seed(13)
    w13, w2 = _weights(g, torch.float32)
    got = moe.fused_moe(torch.zeros((0, H)), w13, w2, torch.zeros((0, K)),
                        torch.zeros((0, K), dtype=torch.int64))
    assert got.shape == (0, H) and got.dtype == torch.float32
    with pytest.raises(TypeError, match="weights of x's dtype"):
        moe.fused_moe(torch.zeros((1, H), dtype=torch.bfloat16), w13, w2,
                      torch.ones((1, K)), torch.zeros((1, K), dtype=torch.int64))


def test_registered_for_the_interpreter_and_cuda() -> None:
    """The interpreter device runs the Triton kernel; cuda ranks it against the dense one."""
    names = [k.name for k in interpreter_kernels("triton-interpret") if k.op == "fused_moe"]
    assert names == ["fused_moe_triton"]
    names = [k.name for k in cuda_kernels("cuda") if k.op == "fused_moe"]
    assert names == ["fused_moe_triton", "fused_moe_dense"]
