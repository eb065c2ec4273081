"""A fresh native cache compiles the CPU plugin's C sources side by side (native_build.prebuild)
and `build_library` then loads them without compiling; a source that does not compile is left
for `build_library` to report, never raised by the prebuild."""
from __future__ import annotations

from pathlib import Path

import pytest
from tessellm_cpu import native_build
from tessellm_cpu.native_linear import NATIVE


def test_prebuild_compiles_every_missing_source_once(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSELLM_CACHE_DIR", str(tmp_path))
    sources = [NATIVE / "token_ops.c", NATIVE / "linear_amx.c"]
    compiled: list[str] = []
    real = native_build._compile
    monkeypatch.setattr(native_build, "_compile",
                        lambda cc, src, *a: (compiled.append(src.name), real(cc, src, *a))[1])
    native_build.prebuild(sources)
    assert sorted(compiled) == ["linear_amx.c", "token_ops.c"]
    for s in sources:
        assert native_build.library_path(s, native_build.library_key(s)).exists()
    compiled.clear()
    lib = native_build.build_library(NATIVE / "token_ops.c")
    assert compiled == [] and lib.path.exists()
    native_build.prebuild(sources)   # all cached: nothing compiles
    assert compiled == []


def test_a_source_that_does_not_compile_is_left_to_build_library(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSELLM_CACHE_DIR", str(tmp_path / "cache"))
    bad = tmp_path / "broken.c"
    bad.write_text("this is not C\n")
    good = tmp_path / "good.c"
    good.write_text("int answer(void) { return 42; }\n")
    native_build.prebuild([bad, good])   # no exception
    assert native_build.build_library(good).lib.answer() == 42
    with pytest.raises(native_build.NativeBuildError, match="broken.c"):
        native_build.build_library(bad)


AMX_KERNELS = {"linear_amx_native", "linear_packed_amx", "linear_q8act_amx"}


def test_a_cpu_without_amx_compiles_no_amx_source_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TESSELLM_CPU_NO_AMX=1 (or a CPU whose flags lack AMX): the AMX sources are not
    compiled, their kernels are not offered and each is named with the reason."""
    from tessellm_cpu.kernels import cpu_kernels
    monkeypatch.setenv("TESSELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TESSELLM_CPU_NO_AMX", "1")
    compiled: list[str] = []
    real = native_build._compile
    monkeypatch.setattr(native_build, "_compile",
                        lambda cc, src, *a: (compiled.append(src.name), real(cc, src, *a))[1])
    not_offered: dict[str, str] = {}
    names = {k.name for k in cpu_kernels("cpu", not_offered)}
    assert compiled and not [c for c in compiled if "amx" in c], compiled
    assert not names & AMX_KERNELS
    assert {n: why for n, why in not_offered.items() if n in AMX_KERNELS} == {
        n: "this CPU has no AMX (amx_bf16, amx_int8, amx_tile not in its flags)"
        for n in AMX_KERNELS}
    assert "linear_packed_native" in names and "fused_moe_packed_grouped" in names


def test_a_cpu_with_amx_flags_builds_its_amx_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    if not {"amx_tile", "amx_bf16", "amx_int8"} <= native_build.host_cpu_flags():
        pytest.skip("this CPU has no AMX")
    from tessellm_cpu.kernels import cpu_kernels
    monkeypatch.delenv("TESSELLM_CPU_NO_AMX", raising=False)
    not_offered: dict[str, str] = {}
    names = {k.name for k in cpu_kernels("cpu", not_offered)}
    assert AMX_KERNELS <= names, not_offered
