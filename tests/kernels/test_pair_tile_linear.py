"""The bfloat16 linears over the pair-tile weight form against F.linear: AMX tiles
(native/linear_amx.c) and AVX-512 BF16 dot products (native/linear_bf16dot.c). Row counts
around the AMX 16- and 32-row groups and the dot-product kernel's 8-row tiles, several row
blocks, bias or none; the weight packing; the refusals. Each is skipped where the machine
lacks its instructions (it is then not offered: see the not-offered tests)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tessellm_cpu.kernels import cpu_kernels
from tessellm_cpu.native_build import NativeBuildError

from tessellm.plugin_api import KernelQuery


def _build_class(kind: str) -> type:
    if kind == "amx":
        from tessellm_cpu.native_amx import NativeAmxLinear
        return NativeAmxLinear
    from tessellm_cpu.native_bf16dot import NativeBf16DotLinear
    return NativeBf16DotLinear


def _build(kind: str):
    return _build_class(kind)()


@pytest.fixture(scope="module", params=["amx", "bf16dot"])
def linear(request):
    """Each pair-tile linear in turn."""
    try:
        return _build(request.param)
    except NativeBuildError as e:
        pytest.skip(f"no {request.param} linear here: {e}")


def _bf16(gen, *shape, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("rows", [0, 1, 3, 8, 9, 15, 16, 17, 32, 33, 64, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(linear, rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    n, k = 96, 128
    x, w = _bf16(gen, rows, k), _bf16(gen, n, k, scale=k ** -0.5)
    b = _bf16(gen, n) if bias else None
    got = linear(x, linear.prepare(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # both sum in float32 and round once; only the order of the sums differs
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)


def test_rows_in_several_blocks_and_a_non_contiguous_input(linear) -> None:
    """K = 2048 gives blocks of 128 rows (both kernels' 512 KiB of x): 300 rows are three
    blocks, the last ending in a partial group of 12 (AMX) / tile of 4 (dot products)."""
    gen = torch.Generator().manual_seed(7)
    x, w = _bf16(gen, 300, 4096)[:, ::2], _bf16(gen, 64, 2048, scale=2048 ** -0.5)
    assert not x.is_contiguous()
    torch.testing.assert_close(linear(x, linear.prepare(w)), F.linear(x, w), rtol=1.6e-2,
                               atol=1e-2)


def test_many_rows_over_several_strip_blocks_and_k_chunks(linear) -> None:
    """Past 64 rows the L1-blocked path: 1088 outputs are 34 strips (17 per thread of two,
    more than one block of 16), K = 320 two K chunks (8 + 2 tile steps), 270 rows two row
    blocks (256 + 14, the last group partial), with a bias."""
    gen = torch.Generator().manual_seed(11)
    x, w, b = _bf16(gen, 270, 320), _bf16(gen, 1088, 320, scale=320 ** -0.5), _bf16(gen, 1088)
    torch.testing.assert_close(linear(x, linear.prepare(w), b), F.linear(x, w, b), rtol=1.6e-2,
                               atol=1e-2)


@pytest.mark.parametrize("rows", [9, 16, 24])
@pytest.mark.parametrize("k", [32, 288])
def test_decode_rows_in_chunks_equal_each_row_alone(linear, rows: int, k: int) -> None:
    """9..24 rows: the dot-product kernel takes each strip in chunks of 4 input blocks (K =
    288: 4 + 4 + 1; K = 32: one partial chunk), its sums waiting in float32 between chunks.
    The sums keep their order, so each row equals that row computed alone (one tile, whole
    strips) to the bit; 96 outputs are 3 strips, split unevenly over two threads."""
    gen = torch.Generator().manual_seed(rows + k)
    x, w, b = _bf16(gen, rows, k), _bf16(gen, 96, k, scale=k ** -0.5), _bf16(gen, 96)
    packed = linear.prepare(w)
    got = linear(x, packed, b)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1.6e-2, atol=1e-2)
    if isinstance(linear, _build_class("bf16dot")):   # AMX tiles sum in their own order
        alone = torch.cat([linear(x[i:i + 1], packed, b) for i in range(rows)])
        assert torch.equal(got, alone)


def test_packed_weight_is_the_same_bytes_in_tile_order(linear) -> None:
    w = torch.arange(64 * 32, dtype=torch.float32).view(64, 32).to(torch.bfloat16)
    packed = linear.prepare(w)
    assert packed.shape == (2, 1, 2, 16, 32) and packed.nbytes == w.nbytes
    # strip 1, tile 0, pair row 3, feature 5: (W[32 + 5][6], W[32 + 5][7])
    assert packed[1, 0, 0, 3, 10:12].tolist() == w[37, 6:8].tolist()
    assert sorted(packed.flatten().float().tolist()) == sorted(w.flatten().float().tolist())


def test_refusals(linear) -> None:
    with pytest.raises(ValueError, match="multiples of 32"):
        linear.prepare(torch.zeros(40, 64, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="bfloat16"):
        linear.prepare(torch.zeros(32, 64))
    packed = linear.prepare(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rows of 64 features"):
        linear(torch.zeros(2, 32, dtype=torch.bfloat16), packed)
    with pytest.raises(TypeError, match="form its prepare makes"):
        linear(torch.zeros(2, 64, dtype=torch.bfloat16),
               torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="a bias of 5 values for 32"):
        linear(torch.zeros(2, 64, dtype=torch.bfloat16), packed, torch.zeros(5))
    dims = lambda k, n: (("bias", 0), ("in_features", k), ("out_features", n))  # noqa: E731
    assert linear.supports(KernelQuery("linear", torch.bfloat16, 8, dims(64, 32)))
    assert not linear.supports(KernelQuery("linear", torch.float32, 8, dims(64, 32)))
    assert not linear.supports(KernelQuery("linear", torch.bfloat16, 8, dims(576, 40)))


def test_offered_after_the_plain_linears_with_its_layout(linear, monkeypatch) -> None:
    monkeypatch.delenv("TESSELLM_CPU_NO_AMX", raising=False)
    linears = [k for k in cpu_kernels("cpu") if k.op == "linear"]
    names = [k.name for k in linears]
    name = {"amx_bf16_tiles": "linear_amx_native",
            "bf16dot_pair_tiles": "linear_bf16dot_native"}[linear.weight_layout.name]
    assert names.index(name) > names.index("linear_aten")
    kernel = linears[names.index(name)]
    assert kernel.weight_layout is not None
    assert kernel.weight_layout.name == linear.weight_layout.name


def test_not_offered_without_amx(monkeypatch) -> None:
    """Where the CPU's flags list AMX but the build has none (or Linux refuses the tile state)
    the kernel is named in not_offered with why, and the other linears stay (a CPU without
    the flags: tests/kernels/test_native_prebuild.py)."""
    import tessellm_cpu.kernels as kernels
    import tessellm_cpu.native_amx as native_amx

    def refuse(self):
        raise NativeBuildError("no AMX here (simulated)")
    monkeypatch.setattr(kernels, "_amx_missing", lambda: [])
    monkeypatch.setattr(native_amx.NativeAmxLinear, "__init__", refuse)
    not_offered: dict[str, str] = {}
    names = [k.name for k in cpu_kernels("cpu", not_offered) if k.op == "linear"]
    assert "linear_amx_native" not in names and "linear_aten" in names
    assert "simulated" in not_offered["linear_amx_native"]


def test_bf16dot_not_offered_without_avx512_bf16(monkeypatch) -> None:
    """A CPU whose flags lack avx512_bf16 names the dot-product linear not offered (no build,
    no warning); the other linears stay."""
    import tessellm_cpu.native_build as native_build
    monkeypatch.setattr(native_build, "host_cpu_flags", lambda: frozenset({"avx512f"}))
    not_offered: dict[str, str] = {}
    names = [k.name for k in cpu_kernels("cpu", not_offered) if k.op == "linear"]
    assert "linear_bf16dot_native" not in names and "linear_aten" in names
    assert "avx512_bf16" in not_offered["linear_bf16dot_native"]

