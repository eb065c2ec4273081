"""Legacy packed weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): the torch quantizers reproduce ggml's bytes, the
dequantizer reproduces gguf's, and every CPU linear_packed kernel equals dequantize-then-matmul.

Tolerance of the kernels (float32 activations): both sides multiply the same dequantized
weights (exact in float32: a fp16 scale times a small integer, plus a fp16 offset), so they
differ only in summation order. With |w| ~ K^-1/2 and x ~ N(0, 1) the outputs are ~N(0, 1), and
reordering K float32 products changes a sum by at most ~K * 2^-24 * sum|w x| ~ 1e-6 for these
K: atol 1e-5 gives 10x margin. bfloat16 activations are converted to float32 by the native
kernel and rounded once at the end (one bf16 ulp, 2^-8 relative), while dequantize-then-matmul
rounds the weights to bf16 first: rtol 1.6e-2, atol 5e-2 (the profiler's bf16 tolerance).
"""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from tessellm_cpu.kernels import cpu_kernels

from tessellm.kernels.reference import embedding_packed, linear_packed
from tessellm.quant.formats import (PACKED_FORMATS, QUANTIZABLE, PackedWeight, concat_rows,
                                    dequantize, quantize)

FORMATS = list(QUANTIZABLE)      # the K-quants: test_k_quants.py
IDS = [f.name for f in FORMATS]
KERNELS = [k for k in cpu_kernels("cpu") if k.op == "linear_packed"]
# (M, N, K): K = 96 and 608 are not multiples of 256 (only of the 32-weight block); odd N.
# K = 2080 is 65 blocks: four whole groups of 16 (the AVX-512 kernels convert the scales of 16
# blocks at once) and one block more; M = 8 is one whole tile of rows, M = 9 one more row.
SHAPES = [(1, 37, 96), (64, 37, 96), (1, 61, 608), (64, 61, 608), (3, 1, 32), (9, 129, 256),
          (1, 6, 2080), (8, 6, 2080)]


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((n, k), generator=g) * k ** -0.5
    w[0, :32] = 0.0                         # an all-zero block: scale 0, no division by zero
    if n > 1:
        w[1, :32] = torch.linspace(-1, 1, 32)  # values on rounding boundaries
    return w


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_quantize_reproduces_ggml_bytes_and_dequantize_gguf_values(fmt) -> None:
    w = _weights(37, 96)
    kind = gguf.GGMLQuantizationType(fmt.ggml_type)
    theirs = gguf_quantize(w.numpy(), kind)
    ours = quantize(w, fmt)
    assert ours.shape == (37, 96) and ours.data.dtype == torch.uint8
    np.testing.assert_array_equal(ours.data.numpy(), theirs)
    np.testing.assert_array_equal(dequantize(ours, torch.float32).numpy(),
                                  gguf_dequantize(theirs, kind))
    # the error is what the format promises: half a step of the block's scale (a whole step
    # for Q4_0 / Q5_0, whose levels -8..7 / -16..15 clip the extreme of the sign opposite to
    # the block's max)
    step = {"Q8_0": 1 / 127 / 2, "Q4_0": 1 / 8, "Q4_1": 1 / 15, "Q5_0": 1 / 16,
            "Q5_1": 1 / 31}[fmt.name]
    err = (dequantize(ours, torch.float32) - w).abs().reshape(37, 3, 32)
    scale = w.reshape(37, 3, 32).abs().amax(-1, keepdim=True)
    assert (err <= scale * step + 1e-3 * scale + 1e-7).all()


def test_packed_weight_rejects_bad_layouts() -> None:
    good = quantize(_weights(4, 64), PACKED_FORMATS[8])
    with pytest.raises(ValueError, match="bytes"):
        PackedWeight(good.data[:, :-1].contiguous(), good.format, 64, torch.float32)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.zeros(4, 40), PACKED_FORMATS[8])
    with pytest.raises(ValueError, match="one format"):
        concat_rows([good, quantize(_weights(4, 64), PACKED_FORMATS[2])])


@pytest.mark.parametrize("kernel", KERNELS, ids=[k.name for k in KERNELS])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_kernel_equals_dequantize_then_matmul(kernel, fmt, m: int, n: int, k: int,
                                              bias: bool) -> None:
    w = quantize(_weights(n, k, seed=m + n), fmt, torch.float32)
    g = torch.Generator().manual_seed(k)
    x = torch.randn((m, k), generator=g)
    b = torch.randn(n, generator=g) if bias else None
    expected = x @ dequantize(w, torch.float32).t() + (b if bias else 0)
    torch.testing.assert_close(kernel.fn(x, w, b), expected, atol=1e-5, rtol=1e-5)
    xb, bb = x.bfloat16(), (b.bfloat16() if bias else None)
    wb = PackedWeight(w.data, w.format, k, torch.bfloat16)
    got = kernel.fn(xb, wb, bb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, linear_packed(xb, wb, bb), rtol=1.6e-2, atol=5e-2)


def test_native_kernel_is_offered_and_reads_views_in_place() -> None:
    assert "linear_packed_native" in {k.name for k in KERNELS}
    native = next(k for k in KERNELS if k.name == "linear_packed_native")
    fused = concat_rows([quantize(_weights(8, 64, s), PACKED_FORMATS[3]) for s in range(3)])
    x = torch.randn(5, 64)
    torch.testing.assert_close(native.fn(x, fused), x @ dequantize(fused, torch.float32).t(),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="features"):
        native.fn(torch.randn(5, 32), fused)


@pytest.mark.parametrize("name", ["linear_packed_native", "linear_packed_amx"])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_native_rows_tiled_together_equal_rows_one_at_a_time(fmt, name) -> None:
    """The native kernel tiles 4 rows of x against 4 weight rows, the AMX one 16 (zero rows
    after the last); every output is computed by the same operations in the same order as
    for a lone row, so the two agree to the bit (a row's result does not depend on the batch
    it came in)."""
    native = next((k for k in KERNELS if k.name == name), None)
    if native is None:
        pytest.skip(f"{name} is not offered on this machine")
    w = quantize(_weights(11, 32 * 19, seed=3), fmt)
    x = torch.randn((18, 32 * 19), generator=torch.Generator().manual_seed(5))
    batched = native.fn(x, w)
    for i in range(x.shape[0]):
        assert torch.equal(batched[i:i + 1], native.fn(x[i:i + 1], w))


@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_embedding_rows_dequantize_to_the_compute_dtype(fmt) -> None:
    w = quantize(_weights(50, 64), fmt, torch.bfloat16)
    ids = torch.tensor([3, 0, 49, 3])
    rows = embedding_packed(ids, w)
    assert rows.dtype == torch.bfloat16 and rows.shape == (4, 64)
    torch.testing.assert_close(rows, dequantize(w)[ids])


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=IDS)
def test_native_embedding_rows_equal_the_reference_to_the_bit(fmt, compute_dtype) -> None:
    native = next(k for k in cpu_kernels("cpu") if k.name == "embedding_packed_native")
    w = quantize(_weights(50, 96), fmt, compute_dtype)
    ids = torch.tensor([3, 0, 49, 3, 17], dtype=torch.int32)   # any integer dtype, repeats
    got = native.fn(ids, w)
    assert got.dtype == compute_dtype and got.shape == (5, 96)
    assert torch.equal(got, embedding_packed(ids.long(), w))
    assert native.fn(torch.tensor([], dtype=torch.int64), w).shape == (0, 96)


def test_native_embedding_refuses_an_id_outside_the_table() -> None:
    native = next(k for k in cpu_kernels("cpu") if k.name == "embedding_packed_native")
    w = quantize(_weights(50, 64), FORMATS[0], torch.float32)
    for bad in (50, -1):
        with pytest.raises(IndexError, match=r"outside \[0, 50\)"):
            native.fn(torch.tensor([1, bad]), w)
