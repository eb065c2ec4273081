"""op linear_packed_q8act: int8-rounded input blocks times a packed weight (llama.cpp's way).

The reference rounds each 32-value block of the input as Q8_0 does (d = max|x| / 127, half to
even) and multiplies by the dequantized weight in float32. The CPU plugin's C kernel (AVX-512
VNNI integer dot products over the GGUF blocks read in place; or AMX int8 tiles over blocks
decoded per call) equals it up to float32 rounding
for Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 (the K-quants: test_k_quants.py), any row count, an odd number of blocks and output features not a
multiple of its 4-row groups; it is not the float product (the rounding is real)."""
from __future__ import annotations

import pytest
import torch

from tessellm.kernels import reference as ref
from tessellm.quant.formats import FORMATS_BY_NAME, quantize


def test_q8_blocks_round_half_even_with_the_block_max_at_127():
    x = torch.zeros(2, 32)
    x[0, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -1.5, -0.4])   # d = 127 / 127 = 1
    out = ref.quantize_q8_blocks(x)
    assert out[0, :6].tolist() == [127.0, 0.0, 2.0, 2.0, -2.0, -0.0]   # halves to even
    assert (out[1] == 0).all()                                        # all-zero block stays 0
    q = ref.quantize_q8_blocks(torch.randn(4, 64)).unflatten(-1, (-1, 32))
    steps = q / (q.abs().amax(-1, keepdim=True) / 127)
    assert torch.allclose(steps, steps.round(), atol=1e-3) and steps.abs().max() <= 127.001


@pytest.fixture(scope="module", params=["NativeQ8ActLinear", "NativeQ8ActAmxLinear"])
def native(request):
    """Each C kernel: VNNI dot products, AMX tiles (where this CPU has them)."""
    try:
        from tessellm_cpu import native_linear
        return getattr(native_linear, request.param)()
    except Exception as e:   # no VNNI / AMX or no compiler: the kernel is not offered there
        pytest.skip(f"native {request.param} unavailable here: {e}")


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
@pytest.mark.parametrize("m, n, k", [(1, 13, 64), (1, 576, 576), (3, 7, 96), (17, 9, 32 * 33),
                                     (5, 130, 32 * 19)])
def test_native_kernel_equals_the_reference(native, fmt, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = quantize(torch.randn(n, k, generator=g) * k ** -0.5, FORMATS_BY_NAME[fmt])
    x = torch.randn(m, k, generator=g)
    x[0, :32] = 0
    bias = torch.randn(n, generator=g)
    want = ref.linear_packed_q8act(x, w, bias)
    got = native(x, w, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    exact = ref.linear_packed(x, w, bias)
    assert (got - exact).abs().max() > 1e-4   # the input really was rounded


def test_bfloat16_input_comes_back_in_bfloat16(native):
    w = quantize(torch.randn(8, 64), FORMATS_BY_NAME["q4_1"])
    x = torch.randn(2, 64).to(torch.bfloat16)
    out = native(x, w)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref.linear_packed_q8act(x, w), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_rows_tiled_together_equal_rows_one_at_a_time(native, fmt):
    """Each kernel tiles rows of x against groups of weight rows (VNNI: 4 rows; AMX: 16, the
    rest zero-padded); every output is computed by the same operations in the same order as
    for a lone row, so the two agree to the bit (a row's result does not depend on the batch
    it came in)."""
    g = torch.Generator().manual_seed(7)
    w = quantize(torch.randn(11, 32 * 19, generator=g) * 0.1, FORMATS_BY_NAME[fmt])
    x = torch.randn(18, 32 * 19, generator=g)   # whole tiles and rows after them
    batched = native(x, w)
    for i in range(x.shape[0]):
        assert torch.equal(batched[i:i + 1], native(x[i:i + 1], w))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_1"])
def test_the_build_without_vbmi_equals_the_reference(tmp_path, fmt):
    """With VBMI the C kernel takes a run of Q4_x / Q8_0 blocks' weights out of its 64-byte
    lines by one byte permute; AVX-512 CPUs without it (Skylake-SP, Cascade Lake) load them by
    16- and 32-byte loads instead. That build, compiled here with -mno-avx512vbmi, equals the
    reference too (partial runs of 1, 2 and 3 blocks included)."""
    import ctypes
    import subprocess

    from tessellm_cpu.native_build import FLAGS, NativeBuildError, host_cpu_flags
    from tessellm_cpu.native_linear import NATIVE, PackedLinearArgs
    if not {"avx512bw", "avx512_vnni"} <= host_cpu_flags():
        pytest.skip("this CPU has no AVX-512 VNNI: the kernel is not offered here")
    try:
        from tessellm_cpu.native_build import _compiler
        cc = _compiler()
    except NativeBuildError as e:
        pytest.skip(f"no C compiler: {e}")
    lib = tmp_path / "linear_q8act_no_vbmi.so"
    subprocess.run([cc, *FLAGS, "-mno-avx512vbmi", str(NATIVE / "linear_q8act.c"), "-o", str(lib),
                    "-lm"], check=True, capture_output=True, timeout=300)
    run = ctypes.CDLL(str(lib)).linear_q8act_run
    run.restype = ctypes.c_int
    for m, n, k in [(1, 13, 64), (1, 9, 32 * 19), (3, 7, 96), (5, 6, 32 * 33)]:
        g = torch.Generator().manual_seed(m * 100 + k)
        w = quantize(torch.randn(n, k, generator=g) * k ** -0.5, FORMATS_BY_NAME[fmt])
        x = torch.randn(m, k, generator=g)
        out = torch.empty(m, n)
        args = PackedLinearArgs(x.data_ptr(), m, k, w.data.data_ptr(), n, w.format.ggml_type, None,
                                out.data_ptr(), None)
        assert run(ctypes.byref(args)) == 0
        want = ref.linear_packed_q8act(x, w)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
