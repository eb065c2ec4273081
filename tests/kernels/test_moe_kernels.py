"""Mixture-of-experts kernels against their reference ops (tessellm.kernels.reference_moe).

The reference itself is checked against a token-by-token loop and HF's routers; then every
kernel (the CPU's grouped float and packed kernels, the portable dense ones that XLA and
CUDA use) equals it for token counts from 1 to 300 under skewed routing: one expert takes
every token, one takes none (kernels.moe_examples.skewed_routing), and under a routing where
every token picks the same top_k experts.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tessellm_cpu.kernels import cpu_kernels

from tessellm.kernels import portable
from tessellm.kernels.moe_examples import skewed_routing
from tessellm.kernels.reference_moe import (fused_moe, fused_moe_packed,
                                            fused_moe_packed_q8act, moe_router)
from tessellm.quant.formats import FORMATS_BY_NAME, packed_example

H, I, E, K = 64, 32, 6, 2
TOKEN_COUNTS = [1, 2, 3, 5, 8, 16, 31, 64, 100, 129, 255, 300]
CPU_KERNELS = [k for k in cpu_kernels("cpu") if k.op.startswith("fused_moe")]
CPU = {k.name: k.fn for k in CPU_KERNELS}
FLOAT_KERNELS = {"fused_moe_grouped": CPU["fused_moe_grouped"],
                 "fused_moe_dense": portable.fused_moe_dense}
PACKED_KERNELS = {k.name: k.fn for k in CPU_KERNELS if k.op == "fused_moe_packed"}
PACKED_KERNELS["fused_moe_packed_dense"] = portable.fused_moe_packed_dense


def _weights(seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn((E * 2 * I, H), generator=g) * H ** -0.5).to(dtype)
    w2 = (torch.randn((E * H, I), generator=g) * I ** -0.5).to(dtype)
    return g, w13, w2


def _loop(x, w13, w2, weights, ids):
    """Token by token, expert by expert: the definition."""
    out = torch.zeros_like(x, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = x[t] @ w13[e * 2 * I:(e + 1) * 2 * I].t()
            a = F.silu(h[:I]) * h[I:]
            out[t] += weights[t, j] * (a @ w2[e * H:(e + 1) * H].t())
    return out.to(x.dtype)


def test_reference_equals_the_token_loop() -> None:
    g, w13, w2 = _weights(0)
    x = torch.randn((9, H), generator=g)
    weights, ids = skewed_routing(9, E, K, g)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids),
                               _loop(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_skewed_routing_is_skewed() -> None:
    g = torch.Generator().manual_seed(3)
    weights, ids = skewed_routing(50, E, K, g)
    assert (ids[:, 0] == 0).all() and not (ids == E - 1).any()
    assert all(len(set(row.tolist())) == K for row in ids)
    torch.testing.assert_close(weights.sum(-1), torch.ones(50))


@pytest.mark.parametrize("renormalize", [False, True])
def test_router_softmax_matches_hf(renormalize: bool) -> None:
    """Qwen-MoE's router: softmax in float32, top-k, renormalized when norm_topk_prob."""
    logits = torch.randn((20, 8), generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(logits, -1, dtype=torch.float)
    top, idx = torch.topk(probs, 3, dim=-1)
    if renormalize:
        top = top / top.sum(-1, keepdim=True)
    weights, ids = moe_router(logits, 3, renormalize, "softmax")
    assert torch.equal(ids, idx) and ids.dtype == torch.int64
    torch.testing.assert_close(weights, top)


def test_router_sigmoid_and_unknown_scoring() -> None:
    logits = torch.randn((4, 8), generator=torch.Generator().manual_seed(2))
    weights, ids = moe_router(logits, 2, True, "sigmoid")
    top, idx = torch.topk(torch.sigmoid(logits), 2, dim=-1)
    assert torch.equal(ids, idx)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match="unknown router scoring"):
        moe_router(logits, 2, True, "relu")


def _routings(T: int, g: torch.Generator):
    yield "skewed", skewed_routing(T, E, K, g)
    same = torch.tensor([[E - 1, 2]]).repeat(T, 1)   # every token: the same two experts
    yield "same", (torch.full((T, K), 0.5), same)


@pytest.mark.parametrize("name", list(FLOAT_KERNELS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_float_kernels_equal_reference(name: str, dtype: torch.dtype) -> None:
    kernel = FLOAT_KERNELS[name]
    g, w13, w2 = _weights(1, dtype)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1.6e-2,
                                                                          "atol": 5e-2}
    for T in TOKEN_COUNTS:
        x = torch.randn((T, H), generator=g).to(dtype)
        for label, (weights, ids) in _routings(T, g):
            got = kernel(x, w13, w2, weights, ids)
            assert got.shape == (T, H) and got.dtype == dtype, (T, label)
            torch.testing.assert_close(got, fused_moe(x, w13, w2, weights, ids), **tol,
                                       msg=lambda m: f"T={T} {label}: {m}")


def _packed_experts(formats: tuple[str, str], seed: int):
    """(generator, hidden, w13, w2): E stacked packed experts in the (gate/up, down) formats;
    K-quants need 256-wide rows."""
    h, i = (256, 256) if formats[0].endswith("_K") else (H, I)
    g = torch.Generator().manual_seed(seed)
    w13 = packed_example(FORMATS_BY_NAME[formats[0].lower()], E * 2 * i, h, g, scale=h ** -0.5)
    w2 = packed_example(FORMATS_BY_NAME[formats[1].lower()], E * h, i, g, scale=i ** -0.5)
    return g, h, w13, w2


@pytest.mark.parametrize("formats", [("Q8_0", "Q8_0"), ("Q4_0", "Q4_1"), ("Q4_K", "Q6_K")],
                         ids=lambda f: "/".join(f))
@pytest.mark.parametrize("name", list(PACKED_KERNELS))
def test_packed_kernels_equal_reference(name: str, formats: tuple[str, str]) -> None:
    """Stacked packed experts (GGUF's ffn_*_exps); K-quants need 256-wide rows."""
    kernel = PACKED_KERNELS[name]
    g, h, w13, w2 = _packed_experts(formats, 4)
    for T in (1, 3, 17, 64, 300):
        x = torch.randn((T, h), generator=g)
        for label, (weights, ids) in _routings(T, g):
            torch.testing.assert_close(kernel(x, w13, w2, weights, ids),
                                       fused_moe_packed(x, w13, w2, weights, ids),
                                       rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"T={T} {label}: {m}")


def _equal_but_for_rounding_flips(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    """Equal up to float32 rounding, except where a silu-and-mul value (C's expf against
    torch's sigmoid, an ulp apart) sat on a q8 rounding boundary and landed one int8 level
    over: that token's row then moves by one level of the block times its down weights
    (seen: 0.06% of the largest output). At most 1 + a tenth of the rows may do so, each by
    at most 1% of the largest output; a wrong expert, row or scale moves most rows."""
    scale = want.abs().max().item()
    off = ((got - want).abs() > 1e-5 * scale + 1e-5 * want.abs()).any(-1)
    assert off.sum() <= 1 + off.numel() // 10, f"{label}: {off.sum()} of {off.numel()} rows"
    assert (got - want).abs().max() <= 0.01 * scale, label


Q8_FORMATS = [("Q8_0", "Q8_0"), ("Q4_0", "Q4_1"), ("Q5_0", "Q5_1"), ("Q4_K", "Q6_K"),
              ("Q5_K", "Q4_K")]


@pytest.mark.parametrize("formats", Q8_FORMATS, ids=lambda f: "/".join(f))
def test_q8act_kernel_equals_its_reference(formats: tuple[str, str]) -> None:
    """fused_moe_packed_q8act in C (VNNI) equals its reference (each expert linear's input
    rounded to q8_0 blocks) up to float32 rounding, under skewed routing for 1..300 tokens;
    it is not the float-activation layer (the rounding is real); and a token's result does
    not depend on the tokens beside it (its rows tile alone or with others alike)."""
    kernel = CPU.get("fused_moe_q8act_vnni")
    if kernel is None:
        pytest.skip("the VNNI kernels do not build here")
    g, h, w13, w2 = _packed_experts(formats, 6)
    for T in (1, 3, 17, 64, 300):
        x = torch.randn((T, h), generator=g)
        for label, (weights, ids) in _routings(T, g):
            got = kernel(x, w13, w2, weights, ids)
            want = fused_moe_packed_q8act(x, w13, w2, weights, ids)
            _equal_but_for_rounding_flips(got, want, f"T={T} {label}")
            if T == 17:
                assert (got - fused_moe_packed(x, w13, w2, weights, ids)).abs().max() > 1e-5
                for t in (0, 5, 16):
                    alone = kernel(x[t:t + 1], w13, w2, weights[t:t + 1], ids[t:t + 1])
                    assert torch.equal(alone, got[t:t + 1]), (label, t)


def test_q8act_kernel_refuses_bad_ids_and_formats() -> None:
    kernel = CPU.get("fused_moe_q8act_vnni")
    if kernel is None:
        pytest.skip("the VNNI kernels do not build here")
    g = torch.Generator().manual_seed(8)
    w13 = packed_example(FORMATS_BY_NAME["q8_0"], E * 2 * I, H, g)
    w2 = packed_example(FORMATS_BY_NAME["q8_0"], E * H, I, g)
    x = torch.randn((3, H), generator=g)
    weights, ids = skewed_routing(3, E, K, g)
    with pytest.raises(ValueError, match="expert id"):
        kernel(x, w13, w2, weights, torch.full_like(ids, E))
    with pytest.raises(ValueError, match="experts of hidden"):
        kernel(x, w13, packed_example(FORMATS_BY_NAME["q8_0"], E * H - 1, I, g), weights, ids)


def test_empty_step() -> None:
    g, w13, w2 = _weights(2)
    x = torch.zeros((0, H))
    weights, ids = torch.zeros((0, K)), torch.zeros((0, K), dtype=torch.int64)
    for kernel in FLOAT_KERNELS.values():
        assert kernel(x, w13, w2, weights, ids).shape == (0, H)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_native_router_equals_reference(scoring: str, renormalize: bool) -> None:
    router = {k.name: k.fn for k in cpu_kernels("cpu")}.get("moe_router_native")
    if router is None:
        pytest.skip("the native kernels do not build here")
    g = torch.Generator().manual_seed(5)
    for T, E, k in ((1, 8, 2), (7, 60, 4), (300, 128, 8), (3, 4, 4)):
        logits = torch.randn((T, E), generator=g)
        want_w, want_ids = moe_router(logits, k, renormalize, scoring)
        got_w, got_ids = router(logits, k, renormalize, scoring)
        assert torch.equal(got_ids, want_ids), (T, E, k)
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)
    strided = torch.randn((5, 40), generator=g)[:, :32]   # rows of a wider tensor
    assert torch.equal(router(strided, 3, True, scoring)[1],
                       moe_router(strided, 3, True, scoring)[1])
    with pytest.raises(ValueError, match="top_k"):
        router(logits, E + 1, True, scoring)
