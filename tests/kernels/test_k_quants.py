"""K-quant super-blocks (Q4_K, Q5_K, Q6_K): the torch dequantizer gives the `gguf` package's
values to the bit, and every CPU linear_packed / embedding_packed kernel equals
dequantize-then-matmul on random super-blocks with finite scales (no quantizer is needed: any
bytes with finite fp16 scales are a valid super-block).

Tolerance of the kernels (float32 activations): the weights are |w| <~ K^-1/2, x ~ N(0, 1), so
outputs are ~N(0, 1). The native kernel multiplies the same integer levels by the same float32
sub-block scales (for Q6_K: (q * sc) * d where the reference rounds (d * sc) * q, one float32
rounding apart, 2^-24 relative per product) and sums in another order: a difference of at most
~K * 2^-24 * sum|w x| ~ 1e-6 for these K; atol 1e-5 gives 10x margin. bfloat16 activations:
the profiler's bf16 tolerance (rtol 1.6e-2, atol 5e-2), as for the legacy formats.
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from tessellm_cpu.kernels import cpu_kernels

from tessellm.kernels import reference
from tessellm.kernels.reference import embedding_packed, linear_packed
from tessellm.quant.formats import (PACKED_FORMATS, QUANTIZABLE, PackedWeight, dequantize,
                                    quantize, random_packed)

K_QUANTS = [f for f in PACKED_FORMATS.values() if f.block_weights == 256]
IDS = [f.name for f in K_QUANTS]
KERNELS = [k for k in cpu_kernels("cpu") if k.op == "linear_packed"]
# M = 1, 3, 64, 200 (decode, a few rows, whole tiles, past the native kernel's tiles);
# K = 256 (one super-block), 768 (a group of 16 blocks of 32 and half of one), 2048; odd N.
SHAPES = [(m, n, k) for m in (1, 3, 64, 200) for n, k in ((37, 256), (11, 768), (5, 2048))]


def _weight(fmt, n: int, k: int, seed: int, dtype=torch.float32) -> PackedWeight:
    return random_packed(fmt, n, k, torch.Generator().manual_seed(seed), scale=k ** -0.5,
                         compute_dtype=dtype)


def test_the_k_quants_are_packed_formats_of_256_weights_without_a_quantizer() -> None:
    assert IDS == ["Q4_K", "Q5_K", "Q6_K"]
    assert not set(K_QUANTS) & set(QUANTIZABLE)
    with pytest.raises(ValueError, match="no quantizer for Q4_K"):
        quantize(torch.randn(2, 256), K_QUANTS[0])
    with pytest.raises(ValueError, match="multiples of 256"):
        random_packed(K_QUANTS[0], 2, 96, torch.Generator())
    w = _weight(K_QUANTS[2], 3, 512, 0)
    with pytest.raises(ValueError, match="bytes"):
        PackedWeight(w.data[:, :-1].contiguous(), w.format, 512, torch.float32)


@pytest.mark.parametrize("fmt", K_QUANTS, ids=IDS)
def test_dequantize_equals_the_gguf_package_to_the_bit(fmt) -> None:
    for seed in range(3):
        w = _weight(fmt, 7, 768, seed)
        kind = gguf.GGMLQuantizationType(fmt.ggml_type)
        ours = dequantize(w, torch.float32)
        assert ours.shape == (7, 768) and torch.isfinite(ours).all()
        np.testing.assert_array_equal(ours.numpy(), gguf_dequantize(w.data.numpy(), kind))


@pytest.mark.parametrize("kernel", KERNELS, ids=[k.name for k in KERNELS])
@pytest.mark.parametrize("fmt", K_QUANTS, ids=IDS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_kernel_equals_dequantize_then_matmul(kernel, fmt, m: int, n: int, k: int) -> None:
    w = _weight(fmt, n, k, seed=m + n)
    g = torch.Generator().manual_seed(k)
    x = torch.randn((m, k), generator=g)
    b = torch.randn(n, generator=g) if m % 2 else None
    expected = x @ dequantize(w, torch.float32).t() + (b if b is not None else 0)
    torch.testing.assert_close(kernel.fn(x, w, b), expected, atol=1e-5, rtol=1e-5)
    if m > 64:
        return
    wb = PackedWeight(w.data, w.format, k, torch.bfloat16)
    got = kernel.fn(x.bfloat16(), wb, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, linear_packed(x.bfloat16(), wb), rtol=1.6e-2, atol=5e-2)


@pytest.mark.parametrize("fmt", K_QUANTS, ids=IDS)
def test_native_rows_tiled_together_equal_rows_one_at_a_time(fmt) -> None:
    native = next(k for k in KERNELS if k.name == "linear_packed_native")
    w = _weight(fmt, 9, 768, seed=3)
    x = torch.randn((10, 768), generator=torch.Generator().manual_seed(5))
    batched = native.fn(x, w)
    for i in range(x.shape[0]):
        assert torch.equal(batched[i:i + 1], native.fn(x[i:i + 1], w))


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", K_QUANTS, ids=IDS)
def test_native_embedding_rows_equal_the_reference_to_the_bit(fmt, compute_dtype) -> None:
    native = next(k for k in cpu_kernels("cpu") if k.name == "embedding_packed_native")
    w = _weight(fmt, 50, 512, 1, compute_dtype)
    ids = torch.tensor([3, 0, 49, 3, 17])
    got = native.fn(ids, w)
    assert got.dtype == compute_dtype and got.shape == (5, 512)
    assert torch.equal(got, embedding_packed(ids, w))


@pytest.fixture(scope="module", params=["NativeQ8ActLinear", "NativeQ8ActAmxLinear"])
def int8_kernel(request):
    """Each C int8-activation kernel: VNNI dot products, AMX tiles (where this CPU has them)."""
    try:
        from tessellm_cpu import native_linear
        return getattr(native_linear, request.param)()
    except Exception as e:   # no VNNI / AMX or no compiler: the kernel is not offered there
        pytest.skip(f"native {request.param} unavailable here: {e}")


@pytest.mark.parametrize("fmt", K_QUANTS, ids=IDS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
def test_int8_activation_kernel_equals_its_reference(int8_kernel, fmt, m: int, n: int,
                                                     k: int) -> None:
    """linear_packed_q8act: the input's 32-value blocks rounded to int8 (the reference's
    rounding, included), then integer dot products per block of 32 (Q6_K: per 16, each
    with its scale; VNNI or AMX tiles): equal to the reference up to float32 rounding, and
    not the float product (the rounding is real)."""
    native = int8_kernel
    w = _weight(fmt, n, k, seed=m + n + 1)
    g = torch.Generator().manual_seed(k + 1)
    x = torch.randn((m, k), generator=g)
    x[0, :32] = 0                                   # an all-zero block: d = 0
    b = torch.randn(n, generator=g)
    want = reference.linear_packed_q8act(x, w, b)
    got = native(x, w, b)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert (got - reference.linear_packed(x, w, b)).abs().max() > 1e-4
