"""The Triton linear_packed (weights dequantized in registers) against dequantize-then-matmul,
through Triton's interpreter on CPU tensors: every packed format (the legacy blocks and the
K-quant super-blocks, random blocks with finite scales), decode (GEMV, M <= 8) and prefill
(GEMM, tl.dot in IEEE float32) row counts, odd N, a bias, bf16 activations.

Tolerance: both sides multiply the same dequantized float32 weights (the Triton kernel uses the
reference's arithmetic per weight) and sum in another order: ~K * 2^-24 * sum|w x| ~ 1e-6 for
|w| ~ K^-1/2, x ~ N(0, 1); atol 1e-5. bf16: the profiler's bf16 tolerance."""
from __future__ import annotations

import pytest
import torch

from tessellm.kernels import reference as ref
from tessellm.kernels.profiler import TOLERANCES
from tessellm.quant.formats import PACKED_FORMATS, PackedWeight, packed_example
from tessellm_cuda.triton_ops import packed_linear

FORMATS = list(PACKED_FORMATS.values())


@pytest.mark.parametrize("fmt", FORMATS, ids=[f.name for f in FORMATS])
@pytest.mark.parametrize("m", [1, 3, 64, 200])
def test_triton_linear_packed_equals_dequantize_then_matmul(fmt, m: int) -> None:
    k = 2 * fmt.block_weights if fmt.block_weights == 256 else 96
    n = 37
    g = torch.Generator().manual_seed(m + fmt.ggml_type)
    w = packed_example(fmt, n, k, g, scale=k ** -0.5)
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g) if m % 2 else None
    got = packed_linear.linear_packed(x, w, b)
    torch.testing.assert_close(got, ref.linear_packed(x, w, b), atol=1e-5, rtol=1e-5)
    if m <= 3:
        wb = PackedWeight(w.data, fmt, k, torch.bfloat16)
        got = packed_linear.linear_packed(x.bfloat16(), wb)
        assert got.dtype == torch.bfloat16
        rtol, atol = TOLERANCES[torch.bfloat16]
        torch.testing.assert_close(got, ref.linear_packed(x.bfloat16(), wb), rtol=rtol,
                                   atol=atol)


def test_empty_batch_and_wrong_width() -> None:
    fmt = PACKED_FORMATS[12]
    w = packed_example(fmt, 5, 256, torch.Generator().manual_seed(0))
    assert packed_linear.linear_packed(torch.randn(0, 256), w).shape == (0, 5)
    with pytest.raises(ValueError, match="256 features"):
        packed_linear.linear_packed(torch.randn(2, 128), w)
