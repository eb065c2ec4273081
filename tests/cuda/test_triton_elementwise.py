"""The Triton elementwise kernels (norms, rotary, silu_and_mul, write_kv_cache) against the
reference ops, run through Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1 before anything imports the kernels)."""
from __future__ import annotations

import math

import pytest
import torch

from tessellm.kernels import reference as ref  # noqa: E402
from tessellm.kernels.profiler import TOLERANCES  # noqa: E402
from tessellm_cuda.triton_ops import activations, kv_cache, norms, rotary  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.dtype == expected.dtype and out.shape == expected.shape
    rtol, atol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units in the last place between two 16-bit float tensors."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.contiguous().view(torch.int16).int()
        mag = bits & 0x7FFF
        return torch.where(bits < 0, -mag, mag)
    return (ordered(a) - ordered(b)).abs()


def _check_norm(out: torch.Tensor, expected: torch.Tensor) -> None:
    _close(out, expected)
    if out.dtype in (torch.float16, torch.bfloat16):
        assert _ulps(out, expected).max().item() <= 1


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


NORM_SHAPES = [(1, 64), (5, 64), (1, 576), (7, 576), (3, 2048)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm(dtype, shape):
    g = _gen(1)
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    _check_norm(norms.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_fused_add_rms_norm(dtype, shape):
    g = _gen(2)
    x = torch.randn(shape, generator=g).to(dtype)
    res = (torch.randn(shape, generator=g) * 4).to(dtype)
    w = (1 + 0.2 * torch.randn(shape[-1], generator=g)).to(dtype)
    x0, res0 = x.clone(), res.clone()
    out, summed = norms.fused_add_rms_norm(x, res, w, 1e-5)
    exp_out, exp_summed = ref.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(summed, exp_summed)
    _check_norm(out, exp_out)
    assert torch.equal(x, x0) and torch.equal(res, res0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_two_pass_path(dtype):
    """Rows wider than the single-tile limit loop over chunks (forced here with small limits;
    576 = 4.5 chunks of 128, so the last chunk is masked)."""
    g = _gen(3)
    x = torch.randn(3, 576, generator=g).to(dtype)
    res = torch.randn(3, 576, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(576, generator=g)).to(dtype)
    out, _ = norms._launch(x, None, w, 1e-6, max_block=128, loop_block=128)
    _check_norm(out, ref.rms_norm(x, w, 1e-6))
    out, summed = norms._launch(x, res, w, 1e-6, max_block=128, loop_block=128)
    exp_out, exp_summed = ref.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, exp_summed)
    _check_norm(out, exp_out)


def test_norms_strided_rows_leading_dims_and_fp32_weight():
    g = _gen(4)
    base = torch.randn(4, 200, generator=g).to(torch.bfloat16)
    x = base[:, 8:136]  # row stride 200
    w32 = 1 + 0.2 * torch.randn(128, generator=g)
    out = norms.rms_norm(x, w32, 1e-6)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref.rms_norm(x, w32, 1e-6), rtol=1e-5, atol=1e-4)
    x3 = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    w = (1 + 0.2 * torch.randn(64, generator=g)).to(torch.bfloat16)
    _check_norm(norms.rms_norm(x3, w, 1e-6), ref.rms_norm(x3, w, 1e-6))
    res = torch.randn(4, 128, generator=g).to(torch.bfloat16)
    out, summed = norms.fused_add_rms_norm(x, res, w32, 1e-6)
    exp_out, exp_summed = ref.fused_add_rms_norm(x, res, w32, 1e-6)
    assert torch.equal(summed, exp_summed)
    torch.testing.assert_close(out, exp_out, rtol=1e-5, atol=1e-4)


def _cos_sin(max_pos: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads,num_tokens",
                         [(8, 4, 2, 1), (64, 4, 1, 5), (80, 6, 2, 3), (128, 8, 2, 2)])
def test_rotary_embedding_fused_qkv_views(dtype, head_dim, num_heads, num_kv_heads,
                                          num_tokens):
    g = _gen(5)
    q_w, kv_w = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_w + 2 * kv_w, generator=g).to(dtype)
    q, k = qkv[:, :q_w], qkv[:, q_w:q_w + kv_w]
    if num_tokens > 1:
        assert not q.is_contiguous() and not k.is_contiguous()
    max_pos = 4096
    cos_sin = _cos_sin(max_pos, head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g)
    positions[0] = max_pos - 1
    before = qkv.clone()
    q_out, k_out = rotary.rotary_embedding(positions, q, k, cos_sin, head_dim)
    exp_q, exp_k = ref.rotary_embedding(positions, q, k, cos_sin, head_dim)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    _close(q_out, exp_q)
    _close(k_out, exp_k)
    if dtype != torch.float32:  # the reference's roundings are reproduced exactly
        assert torch.equal(q_out, exp_q) and torch.equal(k_out, exp_k)
    assert torch.equal(qkv, before)


def test_rotary_embedding_contiguous_inputs():
    g = _gen(6)
    q = torch.randn(3, 4 * 64, generator=g)
    k = torch.randn(3, 4 * 64, generator=g)
    cos_sin = _cos_sin(16, 64)
    positions = torch.tensor([0, 1, 15])
    q_out, k_out = rotary.rotary_embedding(positions, q, k, cos_sin, 64)
    exp_q, exp_k = ref.rotary_embedding(positions, q, k, cos_sin, 64)
    torch.testing.assert_close(q_out, exp_q, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(k_out, exp_k, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(q_out[0], q[0], rtol=0, atol=0)  # position 0: identity


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,d", [(1, 64), (6, 64), (1, 576), (5, 576), (3, 2048)])
def test_silu_and_mul(dtype, num_tokens, d):
    g = _gen(7)
    x = (torch.randn(num_tokens, 2 * d, generator=g) * 3).to(dtype)
    out = activations.silu_and_mul(x)
    expected = ref.silu_and_mul(x)
    _close(out, expected)
    if dtype != torch.float32:
        assert _ulps(out, expected).max().item() <= 1


def test_silu_and_mul_strided_and_leading_dims():
    g = _gen(8)
    base = torch.randn(4, 300, generator=g).to(torch.bfloat16)
    x = base[:, :256]
    _close(activations.silu_and_mul(x), ref.silu_and_mul(x))
    x3 = torch.randn(2, 3, 128, generator=g)
    out = activations.silu_and_mul(x3)
    assert out.shape == (2, 3, 64)
    _close(out, ref.silu_and_mul(x3))


def _kv_case(block_size: int, num_blocks: int, num_kv_heads: int, head_dim: int,
             slots: list[int], src_dtype: torch.dtype, cache_dtype: torch.dtype, seed: int):
    g = _gen(seed)
    t = len(slots)
    kv_w = num_kv_heads * head_dim
    qkv = torch.randn(t, 3 * kv_w + 8, generator=g).to(src_dtype)  # q | k | v | pad
    k, v = qkv[:, kv_w:2 * kv_w], qkv[:, 2 * kv_w:3 * kv_w]
    cache = torch.randn(2, num_blocks, num_kv_heads, block_size, head_dim,
                        generator=g).to(cache_dtype)
    return k, v, cache, torch.tensor(slots, dtype=torch.int64)


def _kv_expected(k, v, cache, slot_mapping):
    expected = cache.clone()  # the reference skips negative (padding) slots too
    ref.write_kv_cache(k, v, expected, slot_mapping)
    return expected


@pytest.mark.parametrize("block_size", [16, 5, 1])
@pytest.mark.parametrize("src_dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16), (torch.float16, torch.bfloat16)])
def test_write_kv_cache(block_size, src_dtype, cache_dtype):
    num_blocks = 12
    n_slots = num_blocks * block_size
    g = _gen(9)
    slots = torch.randperm(n_slots - 1, generator=g)[:7].tolist()  # distinct slots
    slots[2] = -1  # padding tokens: nothing written
    slots[5] = -1
    slots[6] = n_slots - 1  # the last slot of the cache
    k, v, cache, slot_mapping = _kv_case(block_size, num_blocks, 3, 80, slots, src_dtype,
                                         cache_dtype, seed=10)
    assert not k.is_contiguous() and not v.is_contiguous()
    expected = _kv_expected(k, v, cache, slot_mapping)
    k0 = k.clone()
    assert kv_cache.write_kv_cache(k, v, cache, slot_mapping) is None
    assert torch.equal(cache, expected)  # written slots exact, every other entry untouched
    assert torch.equal(k, k0)


def test_write_kv_cache_all_padding_and_gqa_dims():
    k, v, cache, slot_mapping = _kv_case(16, 3, 2, 64, [-1, -1, -1], torch.float16,
                                         torch.float16, seed=11)
    before = cache.clone()
    kv_cache.write_kv_cache(k, v, cache, slot_mapping)
    assert torch.equal(cache, before)
    k, v, cache, slot_mapping = _kv_case(16, 4, 8, 128, [17, 0, 63, 33], torch.bfloat16,
                                         torch.bfloat16, seed=12)
    expected = _kv_expected(k, v, cache, slot_mapping)
    kv_cache.write_kv_cache(k, v, cache, slot_mapping.to(torch.int32))
    assert torch.equal(cache, expected)


def test_bf16_rounding_special_values():
    """float32 -> bfloat16 rounds to nearest-even, like torch (ties, overflow, inf, NaN)."""
    vals = [1 + 2 ** -8, 1 + 3 * 2 ** -8, -(1 + 2 ** -8), 1 + 2 ** -8 + 2 ** -20, 3.4e38,
            -3.4e38, math.inf, -math.inf, 0.0, -0.0, 1e-40, -2.5e-39, 65504.0, math.nan]
    src = torch.tensor(vals, dtype=torch.float32)
    k, v = src.repeat(2).reshape(1, -1), src.flip(0).repeat(2).reshape(1, -1)
    cache = torch.zeros(2, 1, 2, 2, len(vals), dtype=torch.bfloat16)
    kv_cache.write_kv_cache(k, v, cache, torch.tensor([1]))
    for got, want in ((cache[0, 0, :, 1].reshape(-1), k[0]), (cache[1, 0, :, 1].reshape(-1), v[0])):
        exp = want.to(torch.bfloat16)
        assert torch.equal(torch.isnan(got), torch.isnan(exp))
        finite = ~torch.isnan(exp)
        assert torch.equal(got[finite].view(torch.int16), exp[finite].view(torch.int16))
