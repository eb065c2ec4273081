"""The CPU plugin's C per-token kernels (native/token_ops.c) against the reference ops:
rotary embedding, the KV-cache write (slot -1 skipped), RMSNorm plain and fused with the add,
silu_and_mul, the greedy argmax and the token bitmask; float32 and bfloat16, row-strided views of a fused qkv
tensor, and the input checks."""
from __future__ import annotations

import pytest
import torch

from tessellm.kernels import reference as ref
from tessellm.kernels.profiler import TOLERANCES
from tessellm.kernels.examples import bitmask_example
from tessellm_cpu.native_token_ops import (NativeFusedAddRmsNorm, NativeGreedy, NativeRmsNorm,
                                           NativeRotary, NativeSiluAndMul, NativeTokenBitmask,
                                           NativeWriteKV)

DTYPES = [torch.float32, torch.bfloat16]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    rtol, atol = TOLERANCES[want.dtype]
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol)


def _cos_sin(head_dim: int, positions: int = 256) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    f = torch.outer(torch.arange(positions).float(), inv)
    return torch.cat((f.cos(), f.sin()), -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "nh", "nkv", "hd"), [(1, 9, 3, 64), (7, 4, 4, 8),
                                                         (3, 8, 2, 128)])
def test_rotary_matches_reference_on_qkv_views(dtype, tokens, nh, nkv, hd) -> None:
    g = torch.Generator().manual_seed(tokens + hd)
    qkv = torch.randn(tokens, (nh + 2 * nkv) * hd, generator=g).to(dtype)
    q, k = qkv[:, :nh * hd], qkv[:, nh * hd:(nh + nkv) * hd]
    pos = torch.randint(0, 256, (tokens,), generator=g)
    before = qkv.clone()
    got, want = NativeRotary()(pos, q, k, _cos_sin(hd), hd), ref.rotary_embedding(
        pos, q, k, _cos_sin(hd), hd)
    for a, b in zip(got, want):
        _close(a, b)
    assert torch.equal(qkv, before)


def test_rotary_refuses_positions_outside_the_table() -> None:
    q, k = torch.randn(2, 64), torch.randn(2, 64)
    with pytest.raises(ValueError, match="outside the rotary table"):
        NativeRotary()(torch.tensor([0, 256]), q, k, _cos_sin(64), 64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_write_kv_matches_reference_and_skips_padding(dtype, block_size) -> None:
    g = torch.Generator().manual_seed(block_size)
    nkv, hd, nb = 3, 16, 6
    qkv = torch.randn(5, 3 * nkv * hd, generator=g).to(dtype)
    k, v = qkv[:, nkv * hd:2 * nkv * hd], qkv[:, 2 * nkv * hd:]
    cache = torch.randn(2, nb, nkv, block_size, hd, generator=g).to(dtype)
    want = cache.clone()
    slots = torch.tensor([3, -1, nb * block_size - 1, block_size + 1, -1])
    ref.write_kv_cache(k, v, want, slots)
    NativeWriteKV()(k, v, cache, slots)
    assert torch.equal(cache, want)


def test_write_kv_refuses_a_slot_past_the_pool_and_writes_nothing() -> None:
    cache = torch.zeros(2, 2, 1, 4, 8)
    with pytest.raises(ValueError, match="outside the KV pool"):
        NativeWriteKV()(torch.ones(2, 8), torch.ones(2, 8), cache, torch.tensor([1, 8]))
    assert not cache.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 576), (6, 64), (3, 2048)])
def test_rms_norms_match_reference(dtype, shape) -> None:
    g = torch.Generator().manual_seed(shape[1])
    x, r = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(shape[1], generator=g).to(dtype)
    x[-1], r[-1] = 0, 0   # eps keeps a zero row finite
    _close(NativeRmsNorm()(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    (n, s), (rn, rs) = NativeFusedAddRmsNorm()(x, r, w, 1e-6), ref.fused_add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(s, rs)
    _close(n, rn)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_over_the_last_dim_of_per_head_views(dtype) -> None:
    """qwen3 normalizes q and k per head: x is [tokens, heads, head_dim], a view of qkv."""
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 6 * 32, generator=g).to(dtype)
    q = qkv[:, :4 * 32].unflatten(-1, (4, 32))
    w = torch.randn(32, generator=g).to(dtype)
    got = NativeRmsNorm()(q, w, 1e-6)
    assert got.shape == q.shape
    _close(got, ref.rms_norm(q, w, 1e-6))


def test_rms_norm_refuses_mixed_dtypes() -> None:
    with pytest.raises(TypeError, match="float32/bfloat16"):
        NativeRmsNorm()(torch.randn(2, 8), torch.randn(8, dtype=torch.bfloat16), 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (64, 2 * 2048), (3, 2 * 21)])
def test_silu_and_mul_matches_reference(dtype, shape) -> None:
    """Rows large enough for the threaded path, and a width not a multiple of 16 (masked
    tail); large inputs of both signs (the sigmoid from exp(-|x|) never overflows)."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 6).to(dtype)
    x[0, 0], x[0, 1] = -100.0, 100.0
    _close(NativeSiluAndMul()(x), ref.silu_and_mul(x))


def test_silu_and_mul_reads_a_row_strided_view() -> None:
    wide = torch.randn(4, 200)
    x = wide[:, :64]
    _close(NativeSiluAndMul()(x), ref.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (1, 15), (1, 16), (2, 17), (5, 1000),
                                             (64, 32000), (1, 49152)])
def test_greedy_follows_torch_argmax(dtype, rows, vocab) -> None:
    """Ties to the lowest index, a NaN beats every number (its first one wins), -0.0 ties
    0.0, an all -inf row picks index 0; every vocabulary tail length (vectors of 16)."""
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, vocab, generator=g).to(dtype)
    for r in range(rows):
        cols = torch.randint(0, vocab, (3,), generator=g).tolist()
        kind = r % 5
        if kind == 1:                                    # a tie at the maximum
            x[r, cols[0]] = x[r, cols[1]] = 20.0
        elif kind == 2:                                  # NaNs behind the maximum
            x[r, min(cols)], x[r, max(cols)] = 20.0, float("nan")
            x[r, cols[2]] = float("nan")
        elif kind == 3:                                  # all -inf
            x[r] = float("-inf")
        elif kind == 4:                                  # the maximum is a signed zero
            x[r] = -x[r].abs() - 1
            x[r, cols[0]], x[r, cols[1]] = -0.0, 0.0
    x[:, -1] = torch.where(torch.arange(rows) % 2 == 0, 30.0, x[:, -1])  # the last column wins
    want = x.argmax(dim=-1)
    assert torch.equal(NativeGreedy()(x), want)
    assert torch.equal(ref.greedy_tokens(x), want)


def test_greedy_reads_row_strided_views_and_refuses_other_shapes() -> None:
    x = torch.randn(6, 300)
    view = x[:, 20:250]
    assert torch.equal(NativeGreedy()(view), view.argmax(dim=-1))
    assert NativeGreedy()(torch.empty(0, 10)).shape == (0,)
    with pytest.raises(TypeError, match="float32/bfloat16 logits"):
        NativeGreedy()(torch.randn(3, 4, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"\[rows, vocab\]"):
        NativeGreedy()(torch.randn(10))
    with pytest.raises(ValueError, match="no entries"):
        NativeGreedy()(torch.empty(2, 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "vocab"), [(1, 1), (2, 31), (4, 32), (3, 33), (7, 1000),
                                             (5, 49153), (64, 32000)])
def test_token_bitmask_equals_the_reference_bit_for_bit(dtype, rows, vocab) -> None:
    """Every word pattern of the example (all ones, none, single bits, random; bits past the
    vocabulary set), on a row-strided view whose other columns stay untouched."""
    x, mask = bitmask_example(rows, vocab, dtype, "cpu", torch.Generator().manual_seed(vocab))
    wide = torch.randn(rows, vocab + 5).to(dtype)
    wide[:, :vocab] = x
    view, want = wide[:, :vocab], x.clone()
    NativeTokenBitmask()(view, mask)
    ref.apply_token_bitmask(want, mask)
    assert torch.equal(view, want) and torch.equal(wide[:, vocab:].isinf(),
                                                   torch.zeros(rows, 5, dtype=torch.bool))


def test_token_bitmask_refuses_a_mask_of_another_shape() -> None:
    with pytest.raises(ValueError, match=r"int32 \[2, 2\]"):
        NativeTokenBitmask()(torch.randn(2, 40), torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32"):
        NativeTokenBitmask()(torch.randn(2, 40), torch.zeros(2, 2, dtype=torch.int64))


def test_portable_build_without_avx512_compiles_loads_and_agrees(tmp_path) -> None:
    """token_ops.c for an x86-64 baseline CPU (its scalar paths): no undeclared function (a
    macro that named another macro's parameters once left symbols undefined, so the library
    failed to load on CPUs without AVX-512), and its greedy and silu_and_mul equal the
    reference, and so does its token bitmask."""
    import ctypes
    import platform
    import shutil
    import subprocess

    from tessellm_cpu.native_token_ops import SOURCE
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the baseline flags below are x86-64's")
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (the CPU plugin builds its kernels with it)"
    lib_path = tmp_path / "token_ops_portable.so"
    subprocess.run([cc, "-O2", "-march=x86-64", "-fopenmp", "-fPIC", "-shared", "-std=c11",
                    "-Werror=implicit-function-declaration", str(SOURCE), "-o", str(lib_path),
                    "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(lib_path))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    x = torch.randn(5, 300)
    x[1, 7] = x[1, 200] = 9.0
    x[2, 50] = float("nan")
    out = torch.empty(5, dtype=torch.int64)
    lib.greedy_f32.argtypes = [p, i64, i64, i64, p]
    assert lib.greedy_f32(x.data_ptr(), 300, 5, 300, out.data_ptr()) == 0
    assert torch.equal(out, x.argmax(-1))
    y = torch.randn(3, 40)
    got = torch.empty(3, 20)
    from tessellm_cpu.native_token_ops import SiluAndMulArgs
    lib.silu_and_mul_f32_run.argtypes = [p]
    args = SiluAndMulArgs(y.data_ptr(), 40, 3, 20, got.data_ptr())
    assert lib.silu_and_mul_f32_run(ctypes.byref(args)) == 0
    _close(got, ref.silu_and_mul(y))
    for dtype, fn in ((torch.float32, lib.apply_token_bitmask_f32),
                      (torch.bfloat16, lib.apply_token_bitmask_bf16)):
        z, mask = bitmask_example(4, 77, dtype, "cpu", torch.Generator().manual_seed(3))
        want = z.clone()
        ref.apply_token_bitmask(want, mask)
        fn.argtypes = [p, i64, p, i64, i64, i64]
        assert fn(z.data_ptr(), 77, mask.data_ptr(), 3, 4, 77) == 0
        assert torch.equal(z, want)
